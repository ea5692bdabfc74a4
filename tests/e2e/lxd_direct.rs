//! Launching and deleting containers directly through the LXD API, as
//! someone other than jujube would: shared by the LXD end-to-end tests and
//! the launch benchmark (`cli/benches/lxd_launch.rs`).

use jujube_providers::lxd::client::{Client, Method};
use serde_json::{json, Value};

/// The image `scripts/lxd-setup` imports.
pub const ALIAS: &str = "jujube-test";

/// What creates container `name` from [`ALIAS`] with `config`.
fn from_alias(name: &str, config: Value) -> Value {
    json!({
        "name": name,
        "type": "container",
        "source": {"type": "image", "alias": ALIAS},
        "config": config,
    })
}

/// Creates a container from [`ALIAS`] with the given config and starts it:
/// what any client must do (create, wait, start, wait).
pub async fn launch_directly(c: &Client, name: &str, config: Value) {
    launch_body(c, name, &from_alias(name, config)).await;
}

/// Creates container `name` (stopped) from [`ALIAS`], tagged with `config`.
// Used by the e2e tests, not by the LXD bench that includes this file too.
#[allow(dead_code)]
pub async fn create_directly(c: &Client, name: &str, config: Value) {
    create_body(c, name, &from_alias(name, config)).await;
}

async fn create_body(c: &Client, name: &str, body: &Value) {
    c.run(Method::POST, "/1.0/instances", Some(body))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
}

/// Creates container `name` as `body` describes it, then starts it.
pub async fn launch_body(c: &Client, name: &str, body: &Value) {
    create_body(c, name, body).await;
    c.run(
        Method::PUT,
        &format!("/1.0/instances/{name}/state"),
        Some(&json!({"action": "start"})),
    )
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("start {name}: {e:?}"));
}

/// Stops (forced) and deletes a container; errors are ignored (it may be
/// gone already).
pub async fn delete_directly(c: &Client, name: &str) {
    let _ = c
        .run(
            Method::PUT,
            &format!("/1.0/instances/{name}/state"),
            Some(&json!({"action": "stop", "force": true})),
        )
        .await;
    let _ = c
        .run(Method::DELETE, &format!("/1.0/instances/{name}"), None)
        .await;
}
