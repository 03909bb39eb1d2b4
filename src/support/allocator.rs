//! The memory allocator of tether's binaries. glibc's malloc spent a fifth to
//! a quarter of the CPU in profiles of the 100,000-stream simulation
//! (`_int_malloc`, `malloc_consolidate` and `free` under the SDK's requests,
//! the HTTP stack and the worker's passes); mimalloc's thread-local free
//! lists serve the same small, short-lived allocations in a fraction of that.
//! Its v2 line holds about what glibc holds per session; v3 (the crate's
//! default) held nearly twice as much, so Cargo.toml asks for v2.
//! The library only names the allocator: each binary installs it with
//! `#[global_allocator]`, so a program embedding tether keeps its own.

/// The allocator `tether` and the benchmark binary install.
pub type Allocator = mimalloc::MiMalloc;

/// An instance to install: `#[global_allocator] static A: Allocator = ALLOCATOR;`.
pub const ALLOCATOR: Allocator = mimalloc::MiMalloc;
