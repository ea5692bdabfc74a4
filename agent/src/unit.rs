//! The unit agent: its unit's lifecycle duties (lifecycles.txt, "Agents"),
//! as one idempotent pass ([`UnitAgent::step`]) run whenever something it can
//! see changes.
//!
//! Alive:
//! - if its service is not Alive, or (a subordinate) no Alive
//!   container-scoped relation with its principal's service remains, it sets
//!   its unit Dying;
//! - it enters the scopes of the Alive relations of its service it belongs
//!   in (a principal entering a container-scoped relation creates its
//!   subordinate there; a subordinate enters only relations with its
//!   principal's service); it leaves the scopes of relations that are not
//!   Alive (which may remove the relation, and the counterpart service);
//! - as deployer of its subordinates: deploys the Alive ones, removes the
//!   undeployed non-Alive ones, recalls and removes the Dead ones.
//!
//! Dying: it leaves every scope, waits for its subordinates to be removed
//! (their agents set them Dead; it recalls and removes them), then sets its
//! unit Dead and stops for good. Its deployer then recalls and removes it.

use crate::api::{
    AgentStatus, ApiError, Connector, ErrorCode, Facade, RelationView, UnitView, WatchTarget,
};
use crate::deployer::{unit_dir_name, Deployer};
use crate::{run_loop, Agent, Result, Step};
use futures_util::future::BoxFuture;
use jujube_core::charm::Scope;
use jujube_core::Life;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;
use tracing::debug;

pub struct UnitAgent {
    api: Arc<dyn Facade>,
    connector: Arc<dyn Connector>,
    name: String,
    machine_dir: Arc<Path>,
    /// Opened on the first pass (the directory scan is the agent's own work).
    deployer: Option<Deployer>,
    reported: Option<(AgentStatus, String)>,
}

/// True when the unit must become Dying by its own agent's hand.
pub fn abandoned(view: &UnitView) -> bool {
    if view.service_life != Life::Alive {
        return true;
    }
    match &view.principal_service {
        Some(ps) => !view.relations.iter().any(|r| {
            r.life == Life::Alive
                && r.scope == Scope::Container
                && r.counterpart_of(&view.service) == Some(ps)
        }),
        None => false,
    }
}

/// Whether the unit belongs in the relation's scope: a subordinate joins a
/// container-scoped relation only with its principal's service.
pub fn belongs_in(view: &UnitView, rel: &RelationView) -> bool {
    match (rel.scope, &view.principal_service) {
        (Scope::Container, Some(ps)) => rel.counterpart_of(&view.service) == Some(ps),
        _ => true,
    }
}

/// `Ok(true)` when the call went through; `Ok(false)` when refused, or when
/// what it was about went meanwhile (the next notice brings whatever
/// explains it).
fn went_through(r: std::result::Result<(), ApiError>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(e) if matches!(e.code, ErrorCode::Refused | ErrorCode::Unauthorized) => {
            debug!(error = %e, "refused for now");
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}

impl UnitAgent {
    pub fn new(
        api: Arc<dyn Facade>,
        connector: Arc<dyn Connector>,
        machine_dir: Arc<Path>,
        name: &str,
    ) -> UnitAgent {
        UnitAgent {
            api,
            connector,
            name: name.to_string(),
            machine_dir,
            deployer: None,
            reported: None,
        }
    }

    /// The unit's directory (its charm is in `charm/`).
    pub fn dir(&self) -> PathBuf {
        self.machine_dir.join(unit_dir_name(&self.name))
    }

    /// Runs until the unit is Dead or gone, or `stop` turns true. Boxed: a
    /// unit agent starts its subordinates' agents, of its own type.
    pub fn run(self, stop: watch::Receiver<bool>) -> BoxFuture<'static, ()> {
        Box::pin(run_loop(self, stop))
    }

    async fn report(&mut self, status: AgentStatus, info: &str) -> Result<()> {
        if self
            .reported
            .as_ref()
            .is_some_and(|(s, i)| *s == status && i == info)
        {
            return Ok(());
        }
        self.api.set_unit_status(&self.name, status, info).await?;
        self.reported = Some((status, info.to_string()));
        Ok(())
    }

    fn deployer(&mut self) -> Result<&mut Deployer> {
        if self.deployer.is_none() {
            let mut d = Deployer::open(
                self.api.clone(),
                self.connector.clone(),
                self.machine_dir.clone(),
            )?;
            d.start_agents();
            self.deployer = Some(d);
        }
        Ok(self.deployer.as_mut().expect("just opened"))
    }
}

impl Agent for UnitAgent {
    fn api(&self) -> &Arc<dyn Facade> {
        &self.api
    }

    fn target(&self) -> WatchTarget {
        WatchTarget::Unit(self.name.clone())
    }

    async fn step(&mut self) -> Result<Step> {
        let view = match self.api.unit(&self.name).await {
            Ok(v) => v,
            // Removed (or never ours): nothing left to do.
            Err(e) if e.is_unauthorized() => return Ok(Step::Done),
            Err(e) => return Err(e.into()),
        };
        let mut acted = false;
        match view.life {
            Life::Dead => return Ok(Step::Done),
            Life::Alive => {
                self.report(AgentStatus::Started, "").await?;
                if abandoned(&view) && went_through(self.api.ensure_dying_unit(&self.name).await)? {
                    return Ok(Step::Again);
                }
                for rel in &view.relations {
                    if rel.life == Life::Alive && !rel.in_scope && belongs_in(&view, rel) {
                        acted |= went_through(self.api.enter_scope(rel.id, &self.name).await)?;
                    } else if rel.life != Life::Alive && rel.in_scope {
                        acted |= went_through(self.api.leave_scope(rel.id, &self.name).await)?;
                    }
                }
                acted |= self.deployer()?.reconcile(&view.subordinates).await?;
            }
            Life::Dying => {
                self.report(AgentStatus::Dying, "").await?;
                for rel in view.relations.iter().filter(|r| r.in_scope) {
                    acted |= went_through(self.api.leave_scope(rel.id, &self.name).await)?;
                }
                acted |= self.deployer()?.reconcile(&view.subordinates).await?;
                let in_scope = view.relations.iter().any(|r| r.in_scope);
                if !acted
                    && !in_scope
                    && view.subordinates.is_empty()
                    && went_through(self.api.ensure_dead_unit(&self.name).await)?
                {
                    return Ok(Step::Done);
                }
            }
        }
        Ok(if acted { Step::Again } else { Step::Idle })
    }

    async fn failed(&mut self, message: &str) {
        let _ = self.report(AgentStatus::Error, message).await;
    }

    async fn finish(&mut self) {
        if let Some(d) = self.deployer.as_mut() {
            d.stop().await;
        }
    }
}
