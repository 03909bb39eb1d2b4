//! The memory allocator of tether's binaries (`tether` and the benchmark's
//! simulated fleet), declared by each with `#[global_allocator]`.
//!
//! Why not the C library's: a worker taking streams over makes a DynamoDB
//! request per stream, and the AWS SDK allocates and frees hundreds of small
//! objects for each. Under glibc's allocator about a quarter to two fifths
//! of a taking-over worker's CPU went to `malloc`, `free` and their
//! consolidation of freed chunks (`perf`, bench/README.md). jemalloc keeps
//! per-thread caches and size-class slabs instead: a takeover's CPU per
//! acquire fell by about two fifths, and unlike mimalloc (measured and
//! dropped in an earlier round) it did not add to the memory a session
//! holds (bench/README.md, "Memory per session").
pub use tikv_jemallocator::Jemalloc as Allocator;
