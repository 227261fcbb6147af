//! What a crash can leave in the state dir, removed at the next start (the
//! controller owns the dir: one controller per state dir, under its lock):
//!
//! - temp files of atomic metadata writes (`.<name>.tmp-<pid>`) and copies
//!   that never got renamed into place (`*.partial`);
//! - volume directories without a record (a delete that crashed half way;
//!   a create writes its record before any data) when no loop device holds
//!   an image in them;
//! - snapshot directories without a record (a snapshot whose copy was made
//!   but whose record was not written, or a delete that crashed half way);
//! - volumes still `Creating`: their CreateVolume never answered, so no one
//!   knows them; a retry of that CreateVolume makes the volume anew.

use std::path::Path;

use crate::backend::meta::MetaStore;
use crate::kernel::files;
use crate::kernel::loop_device;

fn is_temp(name: &str) -> bool {
    (name.starts_with('.') && name.contains(".tmp-")) || name.ends_with(".partial")
}

/// Removes the leftovers described in the module docs; logs what it did.
pub(super) fn clean(state_dir: &Path, store: &MetaStore) {
    for v in store.volumes() {
        if v.state != crate::backend::meta::VolumeState::Creating {
            continue;
        }
        let id = v.volume_id();
        match store.remove_volume(&id) {
            Ok(()) => {
                tracing::info!(volume = %id, name = %v.name, "removed a volume whose creation a crash interrupted (a retried CreateVolume makes it anew)")
            }
            Err(e) => {
                tracing::warn!(volume = %id, error = %e, "cannot remove an interrupted creation")
            }
        }
    }
    let held: Vec<(u64, u64)> = loop_device::list()
        .unwrap_or_default()
        .iter()
        .map(|l| (l.backing_dev, l.backing_ino))
        .collect();
    for (kind, record) in [("volumes", "volume.json"), ("snapshots", "snapshot.json")] {
        let Ok(entries) = std::fs::read_dir(state_dir.join(kind)) else {
            continue;
        };
        for dir in entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()) {
            let files: Vec<_> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect();
            for f in files
                .iter()
                .filter(|f| f.file_name().and_then(|n| n.to_str()).is_some_and(is_temp))
            {
                match std::fs::remove_file(f) {
                    Ok(()) => tracing::info!(file = %f.display(), "removed a crash leftover"),
                    Err(e) => {
                        tracing::warn!(file = %f.display(), error = %e, "cannot remove a crash leftover")
                    }
                }
            }
            let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let recorded = match kind {
                "volumes" => store.volume_by_id_str(name),
                _ => store.snapshot_by_id_str(name),
            };
            if recorded || dir.join(record).exists() {
                continue;
            }
            let busy = files
                .iter()
                .filter_map(|f| files::dev_ino(f).ok())
                .any(|di| held.contains(&di));
            if busy {
                tracing::warn!(dir = %dir.display(), "unrecorded directory left alone: a loop device still holds an image in it");
                continue;
            }
            for f in &files {
                let _ = files::set_immutable(f, false);
            }
            match std::fs::remove_dir_all(&dir)
                .and_then(|_| files::fsync_dir(&state_dir.join(kind)))
            {
                Ok(()) => {
                    tracing::info!(dir = %dir.display(), "removed a directory no record refers to (left by a crash)")
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an unrecorded directory")
                }
            }
        }
    }
}
