//! Output: `status` and `get` as tables, YAML or JSON.

use crate::Format;
use anyhow::Result;
use jujube_wire::client::ServiceSettings;
use jujube_wire::view::Status;
use serde::Serialize;
use std::io::Write;

/// Left-aligned columns separated by two spaces; no trailing spaces.
fn table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) -> Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        s.trim_end().to_string()
    };
    writeln!(out, "{}", line(header.to_vec()))?;
    for r in rows {
        writeln!(out, "{}", line(r.iter().map(String::as_str).collect()))?;
    }
    Ok(())
}

fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_string()
    } else {
        s.to_string()
    }
}

fn structured<T: Serialize>(value: &T, format: Format, out: &mut impl Write) -> Result<bool> {
    match format {
        // One line, as Juju prints it (`yaml` is the one for people).
        Format::Json => {
            serde_json::to_writer(&mut *out, value)?;
            writeln!(out)?;
        }
        Format::Yaml => yaml_serde::to_writer(&mut *out, value)?,
        Format::Tabular => return Ok(false),
    }
    Ok(true)
}

/// Who runs the provisioner and the cleaner, and whether its lease is
/// current.
fn singletons_line(l: &jujube_wire::view::LeaseStatus, now_ms: i64) -> String {
    let left = l.expires_ms - now_ms;
    if left > 0 {
        format!(
            "Controller `{}` runs the provisioner and the cleaner (lease token {}, {}s left unless renewed)",
            l.holder,
            l.token,
            (left + 999) / 1000
        )
    } else {
        format!(
            "No controller runs the provisioner and the cleaner: the lease of `{}` expired {}s ago (token {}); that controller is stopped or cannot reach the state database (see its log)",
            l.holder,
            (-left) / 1000,
            l.token
        )
    }
}

pub fn status(st: &Status, format: Format, out: &mut impl Write) -> Result<()> {
    let mut out = std::io::BufWriter::new(out);
    if structured(st, format, &mut out)? {
        return Ok(());
    }
    let e = &st.environment;
    table(
        &mut out,
        &["Environment", "Provider", "Series", "Constraints"],
        &[vec![
            e.name.clone(),
            e.provider.clone(),
            e.default_series.clone(),
            dash(&e.constraints),
        ]],
    )?;
    if let Some(l) = &e.singletons {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis() as i64;
        writeln!(out, "{}", singletons_line(l, now_ms))?;
    }
    // With several controllers (`enable-ha`), each one.
    if st.controllers.len() > 1 {
        writeln!(out)?;
        let rows: Vec<Vec<String>> = st
            .controllers
            .iter()
            .map(|c| {
                vec![
                    c.machine.clone(),
                    c.state.clone(),
                    if c.runs_singletons { "yes" } else { "-" }.to_string(),
                    dash(&c.addresses.join(" ")),
                ]
            })
            .collect();
        table(
            &mut out,
            &["Controller", "State", "Singletons", "API"],
            &rows,
        )?;
    }
    if let Some(p) = &e.provider_status {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs() as i64;
        writeln!(
            out,
            "Provider `{}` cannot be reached (for {}s): {}",
            e.provider,
            (now - p.since).max(0),
            p.message
        )?;
    }
    writeln!(out)?;
    let rows: Vec<Vec<String>> = st
        .machines
        .0
        .iter()
        .map(|(id, m)| {
            let message = join_messages(&[
                &m.status_info,
                &m.agent_status_info,
                &refused_message(m.credential_refused.as_deref()),
            ]);
            vec![
                id.clone(),
                m.life.to_string(),
                m.status.clone(),
                m.agent_status.clone(),
                match (&m.instance_id, m.instance_status.as_deref()) {
                    (Some(i), Some("gone")) => format!("{i} (gone)"),
                    (Some(i), _) => i.clone(),
                    (None, _) => "-".into(),
                },
                m.series.clone(),
                dash(&m.constraints),
                message,
            ]
        })
        .collect();
    table(
        &mut out,
        &[
            "Machine",
            "Life",
            "Status",
            "Agent",
            "Instance",
            "Series",
            "Constraints",
            "Message",
        ],
        &rows,
    )?;
    if !st.services.0.is_empty() {
        writeln!(out)?;
        // A service's message: its workload's (the leader's `status-set
        // --application`), then what holds it when Dying.
        let service_message = |s: &jujube_wire::view::ServiceStatus| {
            join_messages(&[&s.workload_status.message, &s.message])
        };
        let service_messages = st
            .services
            .0
            .iter()
            .any(|(_, s)| !service_message(s).is_empty());
        let rows: Vec<Vec<String>> = st
            .services
            .0
            .iter()
            .map(|(name, s)| {
                let mut row = vec![
                    name.clone(),
                    s.charm.clone(),
                    s.life.to_string(),
                    s.workload_status.current.clone(),
                    dash(&s.version),
                    s.series.clone(),
                    if s.subordinate {
                        "-".into()
                    } else {
                        s.units.0.len().to_string()
                    },
                    dash(&s.constraints),
                ];
                if service_messages {
                    row.push(service_message(s));
                }
                row
            })
            .collect();
        let mut headers = vec![
            "Service",
            "Charm",
            "Life",
            "Workload",
            "Version",
            "Series",
            "Units",
            "Constraints",
        ];
        if service_messages {
            headers.push("Message");
        }
        table(&mut out, &headers, &rows)?;
        let mut rows = Vec::new();
        for (_, s) in &st.services.0 {
            for (name, u) in &s.units.0 {
                rows.push(vec![
                    format!("{name}{}", if u.leader { "*" } else { "" }),
                    u.life.to_string(),
                    u.machine.clone().unwrap_or_else(|| "-".into()),
                    u.workload_status.current.clone(),
                    u.agent_status.clone(),
                    unit_message(
                        &u.workload_status.message,
                        &u.agent_status_info,
                        u.credential_refused.as_deref(),
                    ),
                ]);
                for (sub, su) in &u.subordinates.0 {
                    rows.push(vec![
                        format!("  {sub}{}", if su.leader { "*" } else { "" }),
                        su.life.to_string(),
                        String::new(),
                        su.workload_status.current.clone(),
                        su.agent_status.clone(),
                        unit_message(
                            &su.workload_status.message,
                            &su.agent_status_info,
                            su.credential_refused.as_deref(),
                        ),
                    ]);
                }
            }
        }
        if !rows.is_empty() {
            writeln!(out)?;
            table(
                &mut out,
                &["Unit", "Life", "Machine", "Workload", "Agent", "Message"],
                &rows,
            )?;
        }
    }
    if !st.strays.is_empty() {
        writeln!(out)?;
        strays_table(&st.strays, &mut out)?;
        if st.strays_unlisted > 0 {
            writeln!(
                out,
                "and {} more stray instance(s), listed as the first ones are reaped",
                st.strays_unlisted
            )?;
        }
    }
    if !st.relations.is_empty() {
        writeln!(out)?;
        let relation_messages = st.relations.iter().any(|r| !r.message.is_empty());
        let rows: Vec<Vec<String>> = st
            .relations
            .iter()
            .map(|r| {
                let mut row = vec![
                    r.key.clone(),
                    r.interface.clone(),
                    r.scope.clone(),
                    r.life.to_string(),
                ];
                if relation_messages {
                    row.push(r.message.clone());
                }
                row
            })
            .collect();
        let mut headers = vec!["Relation", "Interface", "Scope", "Life"];
        if relation_messages {
            headers.push("Message");
        }
        table(&mut out, &headers, &rows)?;
    }
    Ok(())
}

pub fn settings(doc: &ServiceSettings, format: Format, out: &mut impl Write) -> Result<()> {
    if !structured(&doc, format, out)? {
        let rows: Vec<Vec<String>> = doc
            .settings
            .iter()
            .map(|(k, s)| {
                vec![
                    k.clone(),
                    s.kind.clone(),
                    s.value.as_ref().map(|v| v.to_string()).unwrap_or_default(),
                    if s.default {
                        "default".into()
                    } else {
                        "set".into()
                    },
                ]
            })
            .collect();
        table(out, &["Option", "Type", "Value", "Source"], &rows)?;
    }
    Ok(())
}

fn strays_table(strays: &[jujube_wire::view::Stray], out: &mut impl Write) -> Result<()> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs() as i64;
    let rows: Vec<Vec<String>> = strays
        .iter()
        .map(|s| {
            vec![
                s.instance_id.clone(),
                dash(&s.machine_tag),
                s.class.clone(),
                format!("{}s ago", (now - s.first_seen).max(0)),
                match s.reap_at {
                    Some(at) if at > now => format!("in {}s", at - now),
                    Some(_) => "next pass".to_string(),
                    None => "never (harvest-mode)".to_string(),
                },
            ]
        })
        .collect();
    table(
        out,
        &[
            "Stray instance",
            "Machine tag",
            "Class",
            "First seen",
            "Reaped",
        ],
        &rows,
    )
}

pub fn strays(
    strays: &[jujube_wire::view::Stray],
    format: Format,
    out: &mut impl Write,
) -> Result<()> {
    if !structured(&strays, format, out)? {
        if strays.is_empty() {
            writeln!(out, "no stray instances")?;
            return Ok(());
        }
        strays_table(strays, out)?;
    }
    Ok(())
}

/// What the table says of an agent whose credential the API server refuses.
fn refused_message(since: Option<&str>) -> String {
    since.map_or_else(String::new, |t| {
        format!("credential refused since {t}: an agent presents a secret that is not its current one; start it with the `agent.conf` of its machine's latest start")
    })
}

/// A Message column: the parts that say something, in order.
fn join_messages(parts: &[&str]) -> String {
    parts
        .iter()
        .filter(|s| !s.is_empty())
        .copied()
        .collect::<Vec<_>>()
        .join("; ")
}

/// A unit's Message column: what its charm says, then what its agent says
/// (and a refused credential).
fn unit_message(workload: &str, agent: &str, refused: Option<&str>) -> String {
    join_messages(&[workload, agent, &refused_message(refused)])
}

/// `jujube users`.
pub fn users(
    users: &[jujube_wire::client::UserInfo],
    format: Format,
    out: &mut impl Write,
) -> Result<()> {
    if !structured(&users, format, out)? {
        let rows: Vec<Vec<String>> = users
            .iter()
            .map(|u| {
                vec![
                    u.name.clone(),
                    u.access.to_string(),
                    dash(u.created_by.as_deref().unwrap_or("")),
                    jujube_core::time::format_utc(u64::try_from(u.created_at).unwrap_or(0)),
                    if u.registered { "yes" } else { "no" }.into(),
                ]
            })
            .collect();
        table(
            out,
            &["Name", "Access", "Added by", "Added", "Registered"],
            &rows,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::singletons_line;
    use jujube_wire::view::LeaseStatus;

    #[test]
    fn the_singletons_line_names_the_holder_or_says_nobody_runs_the_jobs() {
        let l = LeaseStatus {
            holder: "machine-0/host".into(),
            token: 3,
            expires_ms: 20_000,
        };
        assert_eq!(
            singletons_line(&l, 8_500),
            "Controller `machine-0/host` runs the provisioner and the cleaner (lease token 3, 12s left unless renewed)"
        );
        assert_eq!(
            singletons_line(&l, 65_000),
            "No controller runs the provisioner and the cleaner: the lease of `machine-0/host` expired 45s ago (token 3); that controller is stopped or cannot reach the state database (see its log)"
        );
    }
}
