//! Reading a charm directory: its metadata, config, actions and revision,
//! each file's errors naming it.

use crate::{refusal, Context, Result};
use jujube_core::actions::CharmActions;
use jujube_core::charm::{CharmConfig, CharmMeta};
use jujube_state::Charm;
use std::path::PathBuf;

/// A charm read from disk, and the series its reference named, if any.
pub struct Loaded {
    pub charm: Charm,
    pub url_series: Option<String>,
}

/// Reads the charm in `dir`, found as a reference naming `url_series`.
pub fn read_dir(dir: PathBuf, url_series: Option<String>) -> Result<Loaded> {
    let meta_path = dir.join("metadata.yaml");
    let meta_text = std::fs::read_to_string(&meta_path)
        .with_context(|| format!("cannot read `{}`", meta_path.display()))?;
    let meta = CharmMeta::parse_file(&meta_path.to_string_lossy(), &meta_text)?;
    let config_path = dir.join("config.yaml");
    let config = match std::fs::read_to_string(&config_path) {
        Ok(text) => CharmConfig::parse_file(&config_path.to_string_lossy(), &meta.name, &text)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => CharmConfig::default(),
        Err(e) => {
            return Err(e)
                .with_context(|| format!("cannot read `{}`", dir.join("config.yaml").display()))
        }
    };
    let actions_path = dir.join("actions.yaml");
    let actions = match std::fs::read_to_string(&actions_path) {
        Ok(text) => CharmActions::parse(&meta.name, &text)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => CharmActions::default(),
        Err(e) => {
            return Err(e).with_context(|| format!("cannot read `{}`", actions_path.display()))
        }
    };
    let revision: u64 = match std::fs::read_to_string(dir.join("revision")) {
        Ok(text) => text.trim().parse().map_err(|_| {
            refusal!(
                "charm `{}` has an invalid revision file; it must hold a whole number",
                meta.name
            )
        })?,
        Err(_) => 0,
    };
    let path = std::fs::canonicalize(&dir).unwrap_or(dir);
    Ok(Loaded {
        charm: Charm {
            // The series part is filled in once the deploy's series is known.
            url: format!("{}-{revision}", meta.name),
            meta,
            config,
            actions,
            path: path.to_string_lossy().into_owned(),
        },
        url_series,
    })
}
