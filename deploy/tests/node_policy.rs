//! The ValidatingAdmissionPolicy that keeps the node plugin to its own Node
//! (deploy/base/policy-node.yaml), evaluated here with a CEL interpreter as the API server
//! would: match conditions, then the variables in order, then every validation. Each
//! refusal case has the allowed request beside it, so the policy cannot pass by refusing
//! everything.

use std::collections::HashMap;
use std::path::PathBuf;

use cel_interpreter::{Context, Program, Value as Cel};
use fencecsi_cluster::well_known::{
    heartbeat_lease_name, HEARTBEAT_LABEL, NODE_CLEAN_ANNOTATION, QUARANTINED_AT_ANNOTATION,
    QUARANTINE_TAINT_KEY,
};
use serde_json::{json, Value};

const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";

fn base_file(name: &str) -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("base")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap()
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

struct Policy {
    name: String,
    match_conditions: Vec<String>,
    variables: Vec<(String, String)>,
    validations: Vec<(String, Message)>,
}

enum Message {
    Text(String),
    /// Evaluated on refusal, with the same variables.
    Expression(String),
}

/// The policy on Nodes.
fn policy() -> Policy {
    policy_in("policy-node.yaml", "", "nodes", &["UPDATE"])
}

/// The policy on heartbeat Leases.
fn heartbeat_policy() -> Policy {
    policy_in(
        "policy-node-heartbeat.yaml",
        "coordination.k8s.io",
        "leases",
        &["CREATE", "UPDATE"],
    )
}

/// The policy in `file`, which must match `operations` on `group`/`resource` (a patch
/// reaches admission as an UPDATE).
fn policy_in(file: &str, group: &str, resource: &str, operations: &[&str]) -> Policy {
    let docs = base_file(file);
    let p = docs
        .iter()
        .find(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .expect("the policy");
    let spec = &p["spec"];
    assert_eq!(spec["failurePolicy"], "Fail");
    let rules = spec["matchConstraints"]["resourceRules"]
        .as_array()
        .unwrap();
    assert!(
        rules.iter().any(|r| r["resources"] == json!([resource])
            && r["operations"] == json!(operations)
            && r["apiGroups"] == json!([group])),
        "{file} must match {operations:?} of {resource}: {rules:?}"
    );
    let list = |key: &str, a: &str, b: &str| -> Vec<(String, String)> {
        spec[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| {
                (
                    v[a].as_str().unwrap_or_default().to_string(),
                    v[b].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect()
    };
    Policy {
        name: p["metadata"]["name"].as_str().unwrap().to_string(),
        match_conditions: list("matchConditions", "expression", "name")
            .into_iter()
            .map(|(e, _)| e)
            .collect(),
        variables: list("variables", "name", "expression"),
        validations: spec["validations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                let text = |k: &str| v[k].as_str().map(str::to_string);
                let message = match (text("message"), text("messageExpression")) {
                    (Some(m), _) => Message::Text(m),
                    (None, Some(e)) => Message::Expression(e),
                    (None, None) => Message::Text(String::new()),
                };
                (text("expression").unwrap(), message)
            })
            .collect(),
    }
}

fn eval(expr: &str, ctx: &Context) -> Result<Cel, String> {
    let p = Program::compile(expr).map_err(|e| format!("{expr}: {e:?}"))?;
    p.execute(ctx).map_err(|e| format!("{expr}: {e:?}"))
}

#[derive(Debug, PartialEq)]
enum Verdict {
    NotMatched,
    Allowed,
    Denied(String),
}

impl Policy {
    fn admit(&self, request: Value, object: &Value, old: &Value) -> Verdict {
        let mut ctx = Context::default();
        ctx.add_variable("request", request).unwrap();
        ctx.add_variable("object", object).unwrap();
        ctx.add_variable("oldObject", old).unwrap();
        for m in &self.match_conditions {
            match eval(m, &ctx) {
                Ok(Cel::Bool(true)) => {}
                Ok(Cel::Bool(false)) => return Verdict::NotMatched,
                other => return Verdict::Denied(format!("match condition: {other:?}")),
            }
        }
        let mut vars: HashMap<String, Cel> = HashMap::new();
        for (name, expr) in &self.variables {
            match eval(expr, &ctx) {
                Ok(v) => {
                    vars.insert(name.clone(), v);
                    ctx.add_variable_from_value("variables", vars.clone());
                }
                Err(e) => return Verdict::Denied(format!("variable {name}: {e}")),
            }
        }
        for (expr, message) in &self.validations {
            match eval(expr, &ctx) {
                Ok(Cel::Bool(true)) => {}
                Ok(_) => {
                    return Verdict::Denied(match message {
                        Message::Text(m) => m.clone(),
                        Message::Expression(e) => match eval(e, &ctx) {
                            Ok(Cel::String(m)) => m.to_string(),
                            other => format!("messageExpression: {other:?}"),
                        },
                    })
                }
                Err(e) => {
                    return Verdict::Denied(format!("evaluation error (failurePolicy Fail): {e}"))
                }
            }
        }
        Verdict::Allowed
    }
}

/// The node plugin's user, from the DaemonSet that runs it.
fn node_plugin_user() -> String {
    let ds = base_file("node.yaml")
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet")
        .unwrap();
    format!(
        "system:serviceaccount:{}:{}",
        ds["metadata"]["namespace"].as_str().unwrap(),
        ds["spec"]["template"]["spec"]["serviceAccountName"]
            .as_str()
            .unwrap()
    )
}

fn request(user: &str, token_node: Option<&str>) -> Value {
    let mut extra = serde_json::Map::new();
    extra.insert(
        "authentication.kubernetes.io/pod-name".into(),
        json!(["fencecsi-node-x"]),
    );
    if let Some(n) = token_node {
        extra.insert(NODE_NAME_EXTRA.into(), json!([n]));
    }
    json!({"operation": "UPDATE", "userInfo": {"username": user, "extra": extra}})
}

/// A quarantined node as podgc leaves it.
fn node(name: &str) -> Value {
    json!({
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name},
            "annotations": {QUARANTINED_AT_ANNOTATION: "2026-11-23T10:00:00Z"},
        },
        "spec": {"taints": [{"key": QUARANTINE_TAINT_KEY, "effect": "NoSchedule"}]},
    })
}

fn with_clean_report(mut n: Value) -> Value {
    n["metadata"]["annotations"][NODE_CLEAN_ANNOTATION] = json!("2026-11-23T10:05:00Z");
    n
}

#[test]
fn the_node_plugin_may_change_only_its_own_nodes_clean_report() {
    let p = policy();
    let me = node_plugin_user();
    let old = node("n1");
    let report = with_clean_report(old.clone());

    // Allowed: its own node's clean report (set, then changed).
    assert_eq!(
        p.admit(request(&me, Some("n1")), &report, &old),
        Verdict::Allowed
    );
    let mut again = report.clone();
    again["metadata"]["annotations"][NODE_CLEAN_ANNOTATION] = json!("2026-11-23T10:09:00Z");
    assert_eq!(
        p.admit(request(&me, Some("n1")), &again, &report),
        Verdict::Allowed
    );

    // Another node's report, from a plugin on n2.
    let v = p.admit(request(&me, Some("n2")), &report, &old);
    assert!(
        matches!(&v, Verdict::Denied(m) if m.contains("only the Node it runs on")),
        "{v:?}"
    );
    // A token without the node name.
    assert!(matches!(
        p.admit(request(&me, None), &report, &old),
        Verdict::Denied(_)
    ));
    // Lifting its own quarantine (the taint).
    let mut lifted = report.clone();
    lifted["spec"] = json!({});
    let v = p.admit(request(&me, Some("n1")), &lifted, &old);
    assert!(
        matches!(&v, Verdict::Denied(m) if m.contains("spec")),
        "{v:?}"
    );
    // Removing podgc's bookkeeping, or relabelling the node.
    let mut unstamped = report.clone();
    unstamped["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove(QUARANTINED_AT_ANNOTATION);
    let v = p.admit(request(&me, Some("n1")), &unstamped, &old);
    assert!(
        matches!(&v, Verdict::Denied(m) if m.contains("node-clean")),
        "{v:?}"
    );
    let mut relabelled = report.clone();
    relabelled["metadata"]["labels"]["x"] = json!("y");
    assert!(matches!(
        p.admit(request(&me, Some("n1")), &relabelled, &old),
        Verdict::Denied(_)
    ));

    // Anyone else (podgc lifting the quarantine) is not this policy's business.
    let podgc = "system:serviceaccount:fencecsi:fencecsi-podgc";
    assert_eq!(
        p.admit(request(podgc, None), &lifted, &old),
        Verdict::NotMatched
    );
}

/// `n` with `metadata.<field>` set to `value`, or without it (`None`).
fn with_meta_field(mut n: Value, field: &str, value: Option<&Value>) -> Value {
    let m = n["metadata"].as_object_mut().unwrap();
    match value {
        Some(v) => {
            m.insert(field.into(), v.clone());
        }
        None => {
            m.remove(field);
        }
    }
    n
}

fn owner_reference(name: &str, uid: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid})
}

/// The node plugin's token may not touch its Node's ownerReferences (one naming an object
/// that does not exist gets the Node garbage-collected) or finalizers: changing, adding
/// and removing are refused, each beside its control, the same clean report with that
/// list left as it was. The policy compares has()-guarded variables rather than
/// `object.metadata.?ownerReferences`: optional types would be within Kubernetes 1.30 (the
/// floor, deploy/README.md), but this interpreter does not parse `.?`.
#[test]
fn the_node_plugin_may_not_change_its_nodes_owner_references_or_finalizers() {
    let p = policy();
    let me = node_plugin_user();
    let lists = [
        (
            "ownerReferences",
            json!([owner_reference("keeper", "uid-1")]),
            json!([owner_reference("other", "uid-2")]),
        ),
        (
            "finalizers",
            json!(["example.com/keep"]),
            json!(["example.com/other"]),
        ),
    ];
    for (field, a, b) in &lists {
        let both = json!([a[0], b[0]]);
        let none = json!([]);
        // (what, the list before, the list the request leaves)
        let refused: [(&str, Option<&Value>, Option<&Value>); 6] = [
            ("changed", Some(a), Some(b)),
            ("added to a Node without one", None, Some(a)),
            ("added beside the one there", Some(a), Some(&both)),
            ("removed, field and all", Some(a), None),
            ("removed, an empty list left", Some(a), Some(&none)),
            ("one of two removed", Some(&both), Some(a)),
        ];
        for (what, before, after) in refused {
            let old = with_meta_field(node("n1"), field, before);
            let changed = with_meta_field(with_clean_report(old.clone()), field, after);
            let v = p.admit(request(&me, Some("n1")), &changed, &old);
            assert!(
                matches!(&v, Verdict::Denied(m) if m.contains(field)),
                "{field} {what}: {v:?}"
            );
            // Control: the same request without that change.
            let control = with_clean_report(old.clone());
            assert_eq!(
                p.admit(request(&me, Some("n1")), &control, &old),
                Verdict::Allowed,
                "{field} {what}: the control"
            );
        }
        // Absent and empty are the same list: writing either over the other changes
        // nothing.
        let absent = node("n1");
        let empty = with_meta_field(node("n1"), field, Some(&json!([])));
        for (old, new) in [(&absent, &empty), (&empty, &absent)] {
            assert_eq!(
                p.admit(
                    request(&me, Some("n1")),
                    &with_clean_report(new.clone()),
                    old
                ),
                Verdict::Allowed,
                "{field}: absent and empty"
            );
        }
    }
    // Anyone else (the garbage collector, another controller) is not this policy's
    // business.
    let old = with_meta_field(node("n1"), "finalizers", Some(&json!(["example.com/keep"])));
    let released = with_meta_field(old.clone(), "finalizers", None);
    assert_eq!(
        p.admit(
            request(
                "system:serviceaccount:kube-system:generic-garbage-collector",
                None
            ),
            &released,
            &old
        ),
        Verdict::NotMatched
    );
}

#[test]
fn the_policies_are_bound_to_deny() {
    for (file, p) in [
        ("policy-node.yaml", policy()),
        ("policy-node-heartbeat.yaml", heartbeat_policy()),
    ] {
        let docs = base_file(file);
        let b = docs
            .iter()
            .find(|d| d["kind"] == "ValidatingAdmissionPolicyBinding")
            .expect("a binding");
        assert_eq!(b["spec"]["policyName"], json!(p.name), "{file}");
        assert!(
            b["spec"]["validationActions"]
                .as_array()
                .unwrap()
                .contains(&json!("Deny")),
            "{file}"
        );
    }
}

/// A heartbeat Lease as the node plugin writes it (driver/src/node/heartbeat.rs).
fn heartbeat(node: &str) -> Value {
    json!({
        "metadata": {
            "name": heartbeat_lease_name(node),
            "namespace": "fencecsi",
            "labels": {HEARTBEAT_LABEL.0: HEARTBEAT_LABEL.1},
        },
        "spec": {"holderIdentity": node, "renewTime": "2026-11-28T10:00:00.000000Z"},
    })
}

#[test]
fn the_node_plugin_may_write_only_its_own_nodes_heartbeat() {
    let p = heartbeat_policy();
    let me = node_plugin_user();
    let create = |token: Option<&str>, lease: &Value| {
        let mut r = request(&me, token);
        r["operation"] = json!("CREATE");
        p.admit(r, lease, &Value::Null)
    };
    let update =
        |token: Option<&str>, lease: &Value| p.admit(request(&me, token), lease, &heartbeat("n1"));
    // Allowed: its own heartbeat, created and renewed.
    assert_eq!(create(Some("n1"), &heartbeat("n1")), Verdict::Allowed);
    assert_eq!(update(Some("n1"), &heartbeat("n1")), Verdict::Allowed);
    let denied = |v: Verdict, why: &str| match v {
        Verdict::Denied(m) => assert!(m.contains(why), "{m}"),
        other => panic!("allowed: {other:?} ({why})"),
    };
    // Another node's heartbeat, kept alive from here.
    denied(
        create(Some("n1"), &heartbeat("n2")),
        "only its own node's heartbeat",
    );
    denied(
        update(Some("n2"), &heartbeat("n1")),
        "only its own node's heartbeat",
    );
    // Its own Lease name naming another holder, and the other way round.
    let mut wrong_holder = heartbeat("n1");
    wrong_holder["spec"]["holderIdentity"] = json!("n2");
    denied(update(Some("n1"), &wrong_holder), "holder: n2");
    let mut no_holder = heartbeat("n1");
    no_holder["spec"] = json!({});
    denied(
        update(Some("n1"), &no_holder),
        "only its own node's heartbeat",
    );
    // A controller's leader-election Lease in the same namespace.
    let mut leader = heartbeat("n1");
    leader["metadata"]["name"] = json!("fencecsi-podgc");
    denied(update(Some("n1"), &leader), "Lease: fencecsi-podgc");
    // Without the label podgc watches by.
    let mut unlabelled = heartbeat("n1");
    unlabelled["metadata"]["labels"] = json!({});
    denied(
        update(Some("n1"), &unlabelled),
        "fencecsi.io/heartbeat=node",
    );
    // A token that names no node.
    denied(create(None, &heartbeat("n1")), "token node: none");
    // Another user is not this policy's to judge.
    assert_eq!(
        p.admit(
            request("system:serviceaccount:fencecsi:fencecsi-controller", None),
            &heartbeat("n2"),
            &Value::Null
        ),
        Verdict::NotMatched
    );
}
