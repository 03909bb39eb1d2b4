//! The `StreamConnection` resource. Doc comments here become the field
//! descriptions `kubectl explain` shows, and the same types parse the manifests
//! `tether apply` reads, so both modes accept exactly one schema.
//!
//! `spec` (the resource, its checks and the CRD), `sink` (`spec.sink`),
//! `value_source` (secret references), `field_error` (what a check returns),
//! `stored` (the one codec of a spec in the lease table).

mod field_error;
mod sink;
mod spec;
pub mod stored;
mod value_source;

pub use field_error::FieldError;
pub use sink::*;
pub use spec::*;
pub use value_source::{HeaderValueSource, SecretKeyRef};
