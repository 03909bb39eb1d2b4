//! The controller's settings (`cli` reads them from `tether operator`'s flags).

use std::time::Duration;

/// Label that assigns a resource to an installation (see `--installation`).
pub(super) const INSTALLATION_LABEL: &str = "tether.dev/installation";
/// Annotation that lets an administrator remove a resource without waiting
/// for the table (for example while it is unreachable); the item left behind
/// is collected later by the garbage collector.
pub(super) const SKIP_CLEANUP_ANNOTATION: &str = "tether.dev/skip-cleanup";
/// Annotation naming the lease table a resource is mirrored into, written by
/// the first controller to mirror it (optimistically, on the resource
/// version). A controller on another table leaves the resource alone, so
/// two installations that select the same resources (two unnamed ones, or
/// two of one name, on different tables) never both run its stream.
pub(super) const TABLE_ANNOTATION: &str = "tether.dev/table";

#[derive(Clone, Debug)]
pub struct ControllerSettings {
    /// This replica (events' reporter instance, the leader Lease's holder).
    pub instance: String,
    pub installation: String,
    /// Empty: every namespace.
    pub namespaces: Vec<String>,
    pub status_refresh: Duration,
    pub progress_interval: Duration,
    pub leader_namespace: String,
    pub leader_lease: Duration,
    pub gc_grace: Duration,
}

impl ControllerSettings {
    /// The label selector of this installation's resources.
    pub fn label_selector(&self) -> String {
        if self.installation.is_empty() {
            format!("!{INSTALLATION_LABEL}")
        } else {
            format!("{INSTALLATION_LABEL}={}", self.installation)
        }
    }

    /// Whether a resource with these labels belongs to this installation
    /// (checked again after the server-side selector).
    pub fn claims(&self, labels: &std::collections::BTreeMap<String, String>) -> bool {
        labels.get(INSTALLATION_LABEL).map_or("", String::as_str) == self.installation
    }

    /// How the installation is recorded on its items: the default (empty)
    /// installation as `default`, so every item written by a controller names
    /// one (an empty attribute would read as absent).
    pub fn item_installation(&self) -> &str {
        if self.installation.is_empty() {
            "default"
        } else {
            &self.installation
        }
    }

    /// Name of the leader-election Lease: one per installation.
    pub fn leader_lease_name(&self) -> String {
        if self.installation.is_empty() {
            "tether-controller".into()
        } else {
            format!("tether-controller-{}", self.installation)
        }
    }
}
