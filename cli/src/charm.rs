//! Finding charms: a charm directory path, or `local:SERIES/NAME` in a
//! repository (`--repository DIR` or `$JUJUBE_REPOSITORY`), laid out as
//! `DIR/SERIES/NAME/`. (Reading one is the controller's `charm::read_dir`.)

use anyhow::{anyhow, bail, Result};
use std::path::{Path, PathBuf};

pub fn resolve(reference: &str, repository: Option<&Path>) -> Result<(PathBuf, Option<String>)> {
    if let Some(rest) = reference.strip_prefix("local:") {
        let (series, name) = match rest.split_once('/') {
            Some((s, n)) => (Some(s.to_string()), n),
            None => (None, rest),
        };
        if let Some(s) = &series {
            jujube_core::series::validate(s)?;
        }
        let repo = repository
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("JUJUBE_REPOSITORY").map(PathBuf::from))
            .ok_or_else(|| anyhow!("charm `{reference}` is a local charm: give its repository with `--repository DIR` or `JUJUBE_REPOSITORY`"))?;
        let dir = match &series {
            Some(s) => repo.join(s).join(name),
            None => repo.join(name),
        };
        if !dir.join("metadata.yaml").is_file() {
            bail!(
                "charm `{reference}` not found in repository `{}` (looked for `{}`); check the series and name",
                repo.display(),
                dir.join("metadata.yaml").display()
            );
        }
        return Ok((dir, series));
    }
    let dir = PathBuf::from(reference);
    if !dir.join("metadata.yaml").is_file() {
        bail!("charm `{reference}` not found: give a charm directory (with a metadata.yaml) or `local:SERIES/NAME` with `--repository DIR`");
    }
    Ok((dir, None))
}
