//! The state directory on a filesystem of its own: xfs on a sparse image, loop-mounted,
//! as a dedicated disk would be. The driver's capacity (less its 5 % reserve) is then this
//! filesystem's, not whatever is left on the host's disk, and the teardown can tell the
//! loop devices fencecsi made (backed by files on it) from everyone else's.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::process::sh;
use crate::say;
use crate::teardown::{Made, Teardown};

/// Makes and mounts `<run_dir>/fencecsi-state` (`bytes` sparse). The teardown detaches
/// every loop device backed by a file on it, then unmounts it: record it before whatever
/// will use it, so that its undo runs after theirs.
pub fn make(run_dir: &Path, bytes: u64, td: &Teardown) -> Result<PathBuf> {
    let image = run_dir.join("fencecsi-state.xfs");
    let f = std::fs::File::create(&image)?;
    f.set_len(bytes)?;
    drop(f);
    sh("mkfs.xfs", &["-q", &image.display().to_string()])?;
    let dir = run_dir.join("fencecsi-state");
    std::fs::create_dir_all(&dir)?;
    sh(
        "mount",
        &[
            "-o",
            "loop",
            &image.display().to_string(),
            &dir.display().to_string(),
        ],
    )?;
    td.record(Made::Mount { path: dir.clone() });
    td.record(Made::LoopDevicesOn {
        dev: std::fs::metadata(&dir)?.dev(),
        what: dir.clone(),
    });
    say(format!(
        "state directory {} (xfs, {} MiB sparse)",
        dir.display(),
        bytes >> 20
    ));
    Ok(dir)
}
