//! Pure translations: PersistentVolume → CSI volume, node → CSI node ID, node state →
//! "may it still be writing?".

use std::collections::HashMap;

use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, PersistentVolumeSpec};
use fencecsi_cluster::k8s_openapi::api::storage::v1::CSINode;
use fencecsi_cluster::well_known;
use fencecsi_proto::v1::volume_capability::access_mode::Mode as AccessMode;
use fencecsi_proto::v1::volume_capability::{AccessType, BlockVolume, MountVolume};
use fencecsi_proto::v1::VolumeCapability;

/// The CSI side of a PersistentVolume.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CsiVolume {
    pub handle: String,
    pub capability: VolumeCapability,
    pub readonly: bool,
    pub context: HashMap<String, String>,
    /// `controllerPublishSecretRef` is set (the seam cannot read Secrets: not sent).
    pub wants_secrets: bool,
}

/// Why a PersistentVolume spec has no CSI volume for this driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum InvalidVolume {
    #[error("the PersistentVolume has no access modes")]
    NoAccessModes,
    #[error("unsupported access modes {0:?}")]
    UnsupportedAccessModes(Vec<String>),
    #[error("the PersistentVolume is not a CSI volume")]
    NotCsi,
    #[error("the PersistentVolume belongs to CSI driver {driver:?}, not {ours:?}")]
    OtherDriver { driver: String, ours: String },
    #[error("the PersistentVolume has an empty volumeHandle")]
    EmptyHandle,
}

/// The CSI access mode for a PV's access modes, as external-attacher chooses it: the
/// broadest mode the PV allows wins.
pub(crate) fn access_mode(modes: &[String]) -> Result<AccessMode, InvalidVolume> {
    let has = |m: &str| modes.iter().any(|x| x == m);
    let (rwo, rox, rwx, rwop) = (
        has("ReadWriteOnce"),
        has("ReadOnlyMany"),
        has("ReadWriteMany"),
        has("ReadWriteOncePod"),
    );
    Ok(if rwx {
        AccessMode::MultiNodeMultiWriter
    } else if rox && rwo {
        AccessMode::MultiNodeSingleWriter
    } else if rox {
        AccessMode::MultiNodeReaderOnly
    } else if rwo {
        AccessMode::SingleNodeWriter
    } else if rwop {
        AccessMode::SingleNodeSingleWriter
    } else if modes.is_empty() {
        return Err(InvalidVolume::NoAccessModes);
    } else {
        return Err(InvalidVolume::UnsupportedAccessModes(modes.to_vec()));
    })
}

/// The CSI volume of a PV (or an inline volume spec) served by `driver`.
pub(crate) fn csi_volume(
    spec: &PersistentVolumeSpec,
    driver: &str,
) -> Result<CsiVolume, InvalidVolume> {
    let csi = spec.csi.as_ref().ok_or(InvalidVolume::NotCsi)?;
    if csi.driver != driver {
        return Err(InvalidVolume::OtherDriver {
            driver: csi.driver.clone(),
            ours: driver.to_string(),
        });
    }
    if csi.volume_handle.is_empty() {
        return Err(InvalidVolume::EmptyHandle);
    }
    let mode = access_mode(spec.access_modes.as_deref().unwrap_or_default())?;
    let block = spec.volume_mode.as_deref() == Some("Block");
    let access_type = if block {
        AccessType::Block(BlockVolume {})
    } else {
        AccessType::Mount(MountVolume {
            fs_type: csi.fs_type.clone().unwrap_or_default(),
            mount_flags: spec.mount_options.clone().unwrap_or_default(),
            ..Default::default()
        })
    };
    Ok(CsiVolume {
        handle: csi.volume_handle.clone(),
        capability: VolumeCapability {
            access_mode: Some(fencecsi_proto::v1::volume_capability::AccessMode {
                mode: mode as i32,
            }),
            access_type: Some(access_type),
        },
        readonly: csi.read_only.unwrap_or(false),
        context: csi
            .volume_attributes
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        wants_secrets: csi.controller_publish_secret_ref.is_some(),
    })
}

/// The node ID `driver` registered on the CSINode object.
pub(crate) fn node_id_from_csinode(csinode: &CSINode, driver: &str) -> Option<String> {
    csinode
        .spec
        .drivers
        .iter()
        .find(|d| d.name == driver && !d.node_id.is_empty())
        .map(|d| d.node_id.clone())
}

/// The node ID from the Node's `csi.volume.kubernetes.io/nodeid` annotation (JSON map
/// driver → ID), the fallback when no CSINode names the driver.
pub(crate) fn node_id_from_annotation(node: &Node, driver: &str) -> Option<String> {
    let raw = node
        .metadata
        .annotations
        .as_ref()?
        .get(well_known::NODE_ID_ANNOTATION)?;
    let map: HashMap<String, String> = serde_json::from_str(raw).ok()?;
    map.get(driver).filter(|s| !s.is_empty()).cloned()
}

/// The name kubelet uses for a CSI volume in `node.status.volumesInUse`.
pub(crate) fn in_use_name(driver: &str, handle: &str) -> String {
    format!("kubernetes.io/csi/{driver}^{handle}")
}

/// Why the node may still be writing to the volume, or `None` when it certainly is not
/// (Ready, untainted, and not listing the volume as in use). `node` is `None` when the
/// Node object is gone.
pub(crate) fn node_may_be_writing(
    node: Option<&Node>,
    driver: &str,
    handle: &str,
) -> Option<String> {
    let Some(node) = node else {
        return Some("the Node object is gone".into());
    };
    if let Some(t) = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .and_then(|ts| {
            ts.iter().find(|t| {
                t.key == well_known::QUARANTINE_TAINT_KEY
                    || t.key == well_known::OUT_OF_SERVICE_TAINT_KEY
            })
        })
    {
        return Some(format!("the node has the {} taint", t.key));
    }
    let status = node.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => {}
        Some(c) => return Some(format!("the node is not Ready (Ready={})", c.status)),
        None => return Some("the node reports no Ready condition".into()),
    }
    let name = in_use_name(driver, handle);
    if status
        .and_then(|s| s.volumes_in_use.as_ref())
        .is_some_and(|v| v.contains(&name))
    {
        return Some("the node still lists the volume in status.volumesInUse".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencecsi_cluster::k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, NodeCondition, NodeSpec, NodeStatus, Taint,
    };
    use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSINodeDriver, CSINodeSpec};
    use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    const D: &str = "loop.fencecsi.io";

    fn modes(m: &[&str]) -> Vec<String> {
        m.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn access_modes_map_to_csi() {
        assert_eq!(
            access_mode(&modes(&["ReadWriteOnce"])).unwrap(),
            AccessMode::SingleNodeWriter
        );
        assert_eq!(
            access_mode(&modes(&["ReadWriteOncePod"])).unwrap(),
            AccessMode::SingleNodeSingleWriter
        );
        assert_eq!(
            access_mode(&modes(&["ReadOnlyMany"])).unwrap(),
            AccessMode::MultiNodeReaderOnly
        );
        assert_eq!(
            access_mode(&modes(&["ReadWriteMany"])).unwrap(),
            AccessMode::MultiNodeMultiWriter
        );
        assert_eq!(
            access_mode(&modes(&["ReadWriteOnce", "ReadOnlyMany"])).unwrap(),
            AccessMode::MultiNodeSingleWriter
        );
        assert!(access_mode(&[]).is_err());
        assert!(access_mode(&modes(&["Sometimes"])).is_err());
        // Status errors and Events carry these texts.
        assert_eq!(
            access_mode(&[]).unwrap_err().to_string(),
            "the PersistentVolume has no access modes"
        );
        assert_eq!(
            access_mode(&modes(&["Sometimes"])).unwrap_err().to_string(),
            r#"unsupported access modes ["Sometimes"]"#
        );
    }

    fn spec(block: bool) -> PersistentVolumeSpec {
        PersistentVolumeSpec {
            access_modes: Some(modes(&["ReadWriteOnce"])),
            volume_mode: Some(if block { "Block" } else { "Filesystem" }.into()),
            mount_options: Some(vec!["noatime".into()]),
            csi: Some(CSIPersistentVolumeSource {
                driver: D.into(),
                volume_handle: "vol-1".into(),
                fs_type: Some("xfs".into()),
                read_only: Some(true),
                volume_attributes: Some([("k".to_string(), "v".to_string())].into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pv_translates_to_a_csi_volume() {
        let v = csi_volume(&spec(false), D).unwrap();
        assert_eq!(v.handle, "vol-1");
        assert!(v.readonly);
        assert_eq!(v.context["k"], "v");
        match v.capability.access_type.unwrap() {
            AccessType::Mount(m) => {
                assert_eq!(m.fs_type, "xfs");
                assert_eq!(m.mount_flags, vec!["noatime".to_string()]);
            }
            other => panic!("{other:?}"),
        }
        let b = csi_volume(&spec(true), D).unwrap();
        assert!(matches!(
            b.capability.access_type,
            Some(AccessType::Block(_))
        ));
        assert!(csi_volume(&spec(false), "other.example.com").is_err());
        assert!(csi_volume(&PersistentVolumeSpec::default(), D).is_err());
        assert_eq!(
            csi_volume(&spec(false), "other.example.com")
                .unwrap_err()
                .to_string(),
            r#"the PersistentVolume belongs to CSI driver "loop.fencecsi.io", not "other.example.com""#
        );
    }

    fn node(ready: &str, taint: Option<&str>, in_use: &[&str]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n".into()),
                annotations: Some(
                    [(
                        well_known::NODE_ID_ANNOTATION.to_string(),
                        format!(r#"{{"{D}":"id-from-annotation"}}"#),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: taint.map(|k| {
                    vec![Taint {
                        key: k.into(),
                        effect: "NoExecute".into(),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: ready.into(),
                    ..Default::default()
                }]),
                volumes_in_use: Some(in_use.iter().map(|s| s.to_string()).collect()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn writing_nodes_are_recognised() {
        let h = "vol-1";
        assert_eq!(
            node_may_be_writing(Some(&node("True", None, &[])), D, h),
            None
        );
        assert!(node_may_be_writing(None, D, h).unwrap().contains("gone"));
        assert!(node_may_be_writing(Some(&node("Unknown", None, &[])), D, h)
            .unwrap()
            .contains("not Ready"));
        assert!(node_may_be_writing(Some(&node("False", None, &[])), D, h).is_some());
        for t in [
            well_known::QUARANTINE_TAINT_KEY,
            well_known::OUT_OF_SERVICE_TAINT_KEY,
        ] {
            assert!(node_may_be_writing(Some(&node("True", Some(t), &[])), D, h)
                .unwrap()
                .contains(t));
        }
        assert_eq!(
            node_may_be_writing(Some(&node("True", Some("other/taint"), &[])), D, h),
            None
        );
        let listed = in_use_name(D, h);
        assert_eq!(listed, "kubernetes.io/csi/loop.fencecsi.io^vol-1");
        assert!(
            node_may_be_writing(Some(&node("True", None, &[&listed])), D, h)
                .unwrap()
                .contains("volumesInUse")
        );
        assert_eq!(
            node_may_be_writing(
                Some(&node(
                    "True",
                    None,
                    &["kubernetes.io/csi/loop.fencecsi.io^vol-2"]
                )),
                D,
                h
            ),
            None
        );
        let mut no_cond = node("True", None, &[]);
        no_cond.status.as_mut().unwrap().conditions = None;
        assert!(node_may_be_writing(Some(&no_cond), D, h).is_some());
    }

    #[test]
    fn node_ids_from_csinode_then_annotation() {
        let cn = CSINode {
            metadata: ObjectMeta::default(),
            spec: CSINodeSpec {
                drivers: vec![
                    CSINodeDriver {
                        name: "other".into(),
                        node_id: "x".into(),
                        ..Default::default()
                    },
                    CSINodeDriver {
                        name: D.into(),
                        node_id: "node-a".into(),
                        ..Default::default()
                    },
                ],
            },
            ..Default::default()
        };
        assert_eq!(node_id_from_csinode(&cn, D).as_deref(), Some("node-a"));
        assert_eq!(node_id_from_csinode(&cn, "missing"), None);
        let n = node("True", None, &[]);
        assert_eq!(
            node_id_from_annotation(&n, D).as_deref(),
            Some("id-from-annotation")
        );
        assert_eq!(node_id_from_annotation(&n, "other"), None);
    }
}
