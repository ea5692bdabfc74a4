//! The machine agent of a machine with job `host-units` (lifecycles.txt,
//! "Agents"): as deployer of the principals assigned to its machine it
//! deploys the Alive ones, removes the undeployed non-Alive ones (removal may
//! remove their service), recalls and removes the deployed Dead ones, and
//! recalls deployed units no longer assigned to it. When its machine is
//! Dying it sets it Dead once no unit remains — the spec's future plan: Dying
//! units are waited for and removed first — and stops for good. (Until this
//! agent existed the controller set Dying machines Dead in its place.)

use crate::api::{AgentStatus, Connector, ErrorCode, Facade, WatchTarget};
use crate::deployer::Deployer;
use crate::{Agent, Result, Running, Step};
use jujube_core::Life;
use std::path::Path;
use std::sync::Arc;
use tracing::info;

pub struct MachineAgent {
    /// Holds the agent's facade, connector and directory too (one copy of
    /// each for 100,000 agents); read on the first pass.
    deployer: Deployer,
    opened: bool,
    id: i64,
    reported: Option<AgentStatus>,
}

impl MachineAgent {
    /// The agent of machine `id`, deploying under `dir` (the machine's own
    /// directory).
    pub fn new(
        api: Arc<dyn Facade>,
        connector: Arc<dyn Connector>,
        id: i64,
        dir: &Path,
    ) -> MachineAgent {
        MachineAgent {
            deployer: Deployer::new(api, connector, Arc::from(dir)),
            opened: false,
            id,
            reported: None,
        }
    }

    /// Starts the agent on the current tokio runtime; it runs until the
    /// machine is Dead or gone, or it is stopped.
    pub fn spawn(self) -> Running {
        crate::run::spawn_with(self)
    }

    async fn report(&mut self, status: AgentStatus, info: &str) -> Result<()> {
        if self.reported == Some(status) && info.is_empty() {
            return Ok(());
        }
        self.deployer
            .api()
            .set_machine_status(self.id, status, &crate::api::fit_status_info(info))
            .await?;
        self.reported = Some(status);
        Ok(())
    }
}

impl crate::run::Driven for MachineAgent {
    fn drive(
        cell: std::sync::Arc<crate::run::Cell<Self>>,
        state: Box<crate::run::Looping<Self>>,
    ) -> futures_util::future::BoxFuture<'static, ()> {
        Box::pin(crate::run::drive(cell, state))
    }
}

impl Agent for MachineAgent {
    fn api(&self) -> &Arc<dyn Facade> {
        self.deployer.api()
    }

    fn target(&self) -> WatchTarget {
        WatchTarget::Machine(self.id)
    }

    fn passes(&self) -> Option<Arc<crate::Passes>> {
        self.deployer.connector().passes()
    }

    async fn step(&mut self) -> Result<Step> {
        let view = match self.deployer.api().machine(self.id).await {
            Ok(v) => v,
            Err(e) if e.is_unauthorized() => return Ok(Step::Done),
            Err(e) => return Err(e.into()),
        };
        self.deployer.connector().machine_view(&view);
        match view.life {
            Life::Dead => return Ok(Step::Done),
            Life::Alive => self.report(AgentStatus::Started, "").await?,
            Life::Dying => self.report(AgentStatus::Dying, "").await?,
        }
        if !self.opened {
            self.deployer.scan()?;
            self.deployer.start_agents();
            self.opened = true;
        }
        let acted = self.deployer.reconcile(&view.units).await?;
        if view.life == Life::Dying && !acted && view.units.is_empty() && self.deployer.is_empty() {
            match self.deployer.api().ensure_dead_machine(self.id).await {
                Ok(()) => {
                    info!(machine = self.id, "machine is dead");
                    return Ok(Step::Done);
                }
                // A unit was assigned meanwhile; its notice follows.
                Err(e) if e.code == ErrorCode::Refused => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Another pass after acting only where it may finish the machine
        // (Dying: once its units are gone it is set Dead); an Alive
        // machine's next change wakes it, and a pass after each deploy
        // re-read its context for nothing.
        Ok(if acted && view.life != Life::Alive {
            Step::Again
        } else {
            Step::Idle
        })
    }

    async fn failed(&mut self, message: &str) {
        self.reported = None;
        let _ = self
            .deployer
            .api()
            .set_machine_status(
                self.id,
                AgentStatus::Failed,
                &crate::api::fit_status_info(message),
            )
            .await;
    }

    async fn finish(&mut self) {
        if self.opened {
            self.deployer.stop().await;
        }
    }
}
