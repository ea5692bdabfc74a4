//! The agents' facade — its trait, [`Facade`], and its plain data — is
//! the wire contract in `jujube-wire` (shared with the API server and its
//! clients); re-exported here for the agents. [`Connector`], how a deployer
//! gets facades for the agents it starts, is the agents' own.

pub use jujube_wire::facade::*;

/// Makes facades for the agents a deployer starts. In process this is the
/// store's facade scoped to the new agent's entity; remotely it is a
/// connection with the credentials the deployer made for the unit.
pub trait Connector: Send + Sync + 'static {
    fn connect(&self, tag: &Tag) -> std::sync::Arc<dyn Facade>;

    /// Where many agents share one process (in the controller), how many
    /// of them may be in a pass at once: see the `run` module. `None`:
    /// no bound (an agent process of its own).
    fn passes(&self) -> Option<std::sync::Arc<crate::Passes>> {
        None
    }

    /// Shown each view of its machine a machine agent reads, as it reads
    /// it (on every change of the machine, the controllers' addresses
    /// among them): what else the agent's process keeps from the view
    /// costs no watch of its own, and the agents nothing. Nothing by
    /// default.
    fn machine_view(&self, _view: &MachineView) {}
}
