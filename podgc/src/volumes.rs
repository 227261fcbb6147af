//! Which terminating pods podgc may force-delete: every volume must be safe to detach from
//! a node that may still be running.
//!
//! A pod volume is
//! - a claim (`persistentVolumeClaim`, or a generic `ephemeral` volume, whose claim is
//!   `<pod>-<volume>`): followed to its bound PersistentVolume; it must be a CSI volume of a
//!   driver whose CSIDriver carries `fencecsi.io/safe-detach: "true"`, and must not be
//!   ReadWriteMany (other nodes may be writing it legitimately; fencing one writer away is not
//!   what such a volume expects). A claim not bound to any PV holds nothing and is ignored.
//! - an inline CSI volume: its driver must be safe-detach.
//! - node-local or data-less (emptyDir, configMap, secret, projected, downwardAPI, hostPath,
//!   image, gitRepo): harmless, ignored.
//! - anything else (nfs, iscsi, rbd, cephfs, fc, cloud disks, flexVolume, ...): network
//!   storage without a fence: the pod is left alone.

use std::collections::HashMap;

use fencecsi_cluster::k8s_openapi::api::core::v1::{
    PersistentVolume, PersistentVolumeClaim, Pod, Volume,
};
use fencecsi_cluster::Cluster;

/// Why a pod is selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeleteReason {
    /// It has CSI volumes, all of safe-detach drivers.
    SafeDetachVolumes,
    /// It has no persistent or network volume at all.
    NoVolumes,
}

impl DeleteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DeleteReason::SafeDetachVolumes => "safe-detach-volumes",
            DeleteReason::NoVolumes => "no-volumes",
        }
    }
}

/// Why a pod is left alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SkipReason {
    DriverNotSafeDetach,
    ReadWriteMany,
    NonCsiVolume,
    UnresolvedClaim,
}

impl SkipReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::DriverNotSafeDetach => "driver-not-safe-detach",
            SkipReason::ReadWriteMany => "read-write-many",
            SkipReason::NonCsiVolume => "non-csi-volume",
            SkipReason::UnresolvedClaim => "unresolved-claim",
        }
    }
}

/// The verdict on one pod, and the PersistentVolumes it uses (selected or not: a PV a pod
/// left on the node still uses keeps its VolumeAttachment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    pub verdict: Result<DeleteReason, (SkipReason, String)>,
    pub pvs: Vec<String>,
}

/// Looks claims and volumes up with single GETs, remembering them for one pass.
pub struct Resolver<'a> {
    cluster: &'a Cluster,
    /// CSIDriver name -> carries safe-detach.
    drivers: &'a HashMap<String, bool>,
    pvcs: HashMap<(String, String), Option<PersistentVolumeClaim>>,
    pvs: HashMap<String, Option<PersistentVolume>>,
}

impl<'a> Resolver<'a> {
    pub fn new(cluster: &'a Cluster, drivers: &'a HashMap<String, bool>) -> Self {
        Resolver {
            cluster,
            drivers,
            pvcs: HashMap::new(),
            pvs: HashMap::new(),
        }
    }

    fn safe(&self, driver: &str) -> bool {
        self.drivers.get(driver).copied().unwrap_or(false)
    }

    async fn pvc(
        &mut self,
        ns: &str,
        name: &str,
    ) -> fencecsi_cluster::Result<Option<PersistentVolumeClaim>> {
        let key = (ns.to_string(), name.to_string());
        if let Some(v) = self.pvcs.get(&key) {
            return Ok(v.clone());
        }
        let v = self
            .cluster
            .api::<PersistentVolumeClaim>(Some(ns))
            .get_opt(name)
            .await?;
        self.pvcs.insert(key, v.clone());
        Ok(v)
    }

    async fn pv(&mut self, name: &str) -> fencecsi_cluster::Result<Option<PersistentVolume>> {
        if let Some(v) = self.pvs.get(name) {
            return Ok(v.clone());
        }
        let v = self
            .cluster
            .api::<PersistentVolume>(None)
            .get_opt(name)
            .await?;
        self.pvs.insert(name.to_string(), v.clone());
        Ok(v)
    }

    /// Classifies `pod`. Errors are cluster errors (the pod is then skipped this pass).
    pub async fn classify(&mut self, pod: &Pod) -> fencecsi_cluster::Result<Classified> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let volumes: &[Volume] = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_deref())
            .unwrap_or(&[]);
        let mut pvs = Vec::new();
        let mut skip: Option<(SkipReason, String)> = None;
        let mut any_csi = false;
        for v in volumes {
            let verdict = match claim_of(v, &pod_name) {
                Some(claim) => {
                    let (pv, verdict) = self.classify_claim(&ns, &claim, v).await?;
                    pvs.extend(pv);
                    verdict
                }
                None => self.classify_inline(v),
            };
            match verdict {
                VolumeVerdict::Fenced => any_csi = true,
                VolumeVerdict::Harmless => {}
                VolumeVerdict::Skip(reason, why) => {
                    skip.get_or_insert((reason, why));
                }
            }
        }
        let verdict = match skip {
            Some(s) => Err(s),
            None if any_csi => Ok(DeleteReason::SafeDetachVolumes),
            None => Ok(DeleteReason::NoVolumes),
        };
        Ok(Classified { verdict, pvs })
    }

    /// A volume through claim `claim`: its PersistentVolume's name once found, and what it
    /// says.
    async fn classify_claim(
        &mut self,
        ns: &str,
        claim: &str,
        v: &Volume,
    ) -> fencecsi_cluster::Result<(Option<String>, VolumeVerdict)> {
        let Some(pvc) = self.pvc(ns, claim).await? else {
            return Ok((None, VolumeVerdict::Skip(SkipReason::UnresolvedClaim, format!("volume {:?}: PersistentVolumeClaim {ns}/{claim} not found, so it cannot be checked", v.name))));
        };
        let pv_name = pvc
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|n| !n.is_empty());
        let Some(pv_name) = pv_name else {
            return Ok((None, VolumeVerdict::Harmless)); // not bound: nothing attached
        };
        let Some(pv) = self.pv(&pv_name).await? else {
            return Ok((None, VolumeVerdict::Skip(SkipReason::UnresolvedClaim, format!("volume {:?}: PersistentVolume {pv_name} of claim {claim} not found, so it cannot be checked", v.name))));
        };
        let spec = pv.spec.as_ref();
        let rwx = |modes: Option<&Vec<String>>| {
            modes.is_some_and(|m| m.iter().any(|m| m == "ReadWriteMany"))
        };
        let verdict = if rwx(spec.and_then(|s| s.access_modes.as_ref()))
            || rwx(pvc.spec.as_ref().and_then(|s| s.access_modes.as_ref()))
        {
            VolumeVerdict::Skip(SkipReason::ReadWriteMany, format!("volume {:?} (PersistentVolume {pv_name}) is ReadWriteMany: other nodes may write it legitimately, so it is not fenced away", v.name))
        } else {
            match spec.and_then(|s| s.csi.as_ref()) {
                Some(csi) if self.safe(&csi.driver) => VolumeVerdict::Fenced,
                Some(csi) => VolumeVerdict::Skip(SkipReason::DriverNotSafeDetach, format!("volume {:?} (PersistentVolume {pv_name}) uses CSI driver {}, whose CSIDriver does not carry {}=\"true\": detaching it from a node that may still be running could corrupt it", v.name, csi.driver, fencecsi_cluster::well_known::SAFE_DETACH_ANNOTATION)),
                None => VolumeVerdict::Skip(SkipReason::NonCsiVolume, format!("volume {:?} (PersistentVolume {pv_name}) is not a CSI volume: nothing fences it", v.name)),
            }
        };
        Ok((Some(pv_name), verdict))
    }

    /// A volume with no claim: an inline CSI volume, one that lives and dies with the pod
    /// or the node, or network storage nothing fences.
    fn classify_inline(&self, v: &Volume) -> VolumeVerdict {
        if let Some(csi) = &v.csi {
            if self.safe(&csi.driver) {
                return VolumeVerdict::Fenced;
            }
            return VolumeVerdict::Skip(SkipReason::DriverNotSafeDetach, format!("inline volume {:?} uses CSI driver {}, whose CSIDriver does not carry {}=\"true\"", v.name, csi.driver, fencecsi_cluster::well_known::SAFE_DETACH_ANNOTATION));
        }
        let harmless = v.empty_dir.is_some()
            || v.config_map.is_some()
            || v.secret.is_some()
            || v.projected.is_some()
            || v.downward_api.is_some()
            || v.host_path.is_some()
            || v.image.is_some()
            || v.git_repo.is_some();
        if harmless {
            VolumeVerdict::Harmless
        } else {
            VolumeVerdict::Skip(
                SkipReason::NonCsiVolume,
                format!(
                    "inline volume {:?} is network storage that nothing fences",
                    v.name
                ),
            )
        }
    }
}

/// What one of a pod's volumes says about force-deleting the pod.
enum VolumeVerdict {
    /// A volume of a safe-detach CSI driver: its detach fences it.
    Fenced,
    /// Nothing to fence: not bound, or gone with the pod or the node.
    Harmless,
    /// The pod is not force-deleted, for this reason.
    Skip(SkipReason, String),
}

/// The claim a volume goes through: its PersistentVolumeClaim, or the one a generic
/// ephemeral volume gets (`<pod>-<volume>`).
fn claim_of(v: &Volume, pod_name: &str) -> Option<String> {
    if let Some(c) = &v.persistent_volume_claim {
        Some(c.claim_name.clone())
    } else if v.ephemeral.is_some() {
        Some(format!("{pod_name}-{}", v.name))
    } else {
        None
    }
}
