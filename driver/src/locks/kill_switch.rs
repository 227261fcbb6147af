//! A controller's kill switch: a FIFO in the state dir that SIGKILLs the process which armed
//! it as soon as anyone opens it for writing and closes it again, or writes to it.
//!
//! The owner arms it before it takes the state dir: it opens the FIFO's read end with
//! `O_ASYNC`, names itself the owner (`F_SETOWN`, its process group when it leads one) and
//! asks for SIGKILL instead of SIGIO (`F_SETSIG`). A write to a FIFO calls `kill_fasync` on
//! its readers (fs/pipe.c `pipe_write`), and so does the close of its last writer
//! (`pipe_release`), which queues that signal to the owner
//! (fs/fcntl.c `send_sigio`), checked against the credentials of whoever armed it, not the
//! writer's. So a successor can kill a former owner that it cannot see: another pid
//! namespace (another node of a one-kernel cluster), no `kill` permission on it, or a
//! frozen cgroup. A frozen task keeps the signal pending and handles it before it runs
//! another instruction of user space (`get_signal`: the refrigerator, then the group exit).
//!
//! Not for the init of a pid namespace (pid 1 in a container of its own): the kernel drops
//! SIGKILL for it unless it comes from an ancestor namespace or the kernel itself
//! (kernel/signal.c `sig_task_ignored`, SIGNAL_UNKILLABLE), and `send_sigio`'s siginfo is
//! neither. So such a process arms nothing ([`KillSwitch::arm`] answers None) and names no
//! switch, and a successor waits for it as for any owner without one. deploy/base runs
//! the controller pod with `shareProcessNamespace`, so that the plugin is not pid 1.
//!
//! A reader's close also signals the readers left when the FIFO has no writer, so nothing but
//! a successor may open a switch: the owner dir is the driver's alone.
//!
//! The writer learns that a reader exists (the open of the write end fails with ENXIO
//! otherwise), not which one: the FIFO's name is unique to the process that armed it, and
//! its read end is close-on-exec and closed before the ownership lock is let go.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The suffix of a switch's FIFO in the owner dir.
const SUFFIX: &str = ".switch";

/// An armed switch: this process dies once anyone writes to [`KillSwitch::path`].
pub(crate) struct KillSwitch {
    name: String,
    path: PathBuf,
    /// The read end; closing it disarms (the FIFO then has no reader).
    fifo: Option<File>,
}

/// What [`fire`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fired {
    /// SIGKILL is queued to the process that armed the switch (or was, by an earlier write).
    Killed,
    /// No process has the switch armed: it never did, or it has closed it (exited, or let
    /// the state dir go). Nothing was sent, so nothing is proven.
    NoListener,
}

impl KillSwitch {
    /// Makes a fresh FIFO in `dir` and arms it for this process (its process group if it
    /// leads one, so that a tool it runs dies with it); None when this process is the init
    /// of its pid namespace, which a switch cannot kill (see the module docs).
    pub(crate) fn arm(dir: &Path) -> io::Result<Option<KillSwitch>> {
        if std::process::id() == 1 {
            tracing::warn!("this process is pid 1 of its pid namespace, which SIGKILL from another namespace cannot end: no kill switch armed, so a successor cannot take the state dir from it while it is frozen (run the pod with shareProcessNamespace: true)");
            return Ok(None);
        }
        let name = uuid::Uuid::new_v4().simple().to_string();
        let path = dir.join(format!("{name}{SUFFIX}"));
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .map_err(io::Error::from)?;
        let mut switch = KillSwitch {
            name,
            path,
            fifo: None,
        };
        // Non-blocking: opening a FIFO's read end would otherwise wait for a writer.
        let fifo = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&switch.path)?;
        arm_fd(&fifo)?;
        switch.fifo = Some(fifo);
        Ok(Some(switch))
    }

    /// The name a successor passes to [`fire`].
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for KillSwitch {
    fn drop(&mut self) {
        // Disarm first, then remove: a successor that still finds the name finds no reader.
        drop(self.fifo.take());
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `fcntl`'s F_SETSIG (include/uapi/asm-generic/fcntl.h), which the libc crate leaves out.
const F_SETSIG: libc::c_int = 10;

/// `F_SETOWN` (negative: a process group), `F_SETSIG` SIGKILL, then `O_ASYNC`, which adds
/// the file to the pipe's fasync list.
fn arm_fd(fifo: &File) -> io::Result<()> {
    let fd = fifo.as_raw_fd();
    let pid = std::process::id() as libc::c_int;
    // SAFETY: plain fcntl calls on a descriptor this function borrows.
    let owner = if unsafe { libc::getpgrp() } == pid {
        -pid
    } else {
        pid
    };
    let check = |r: libc::c_int| {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    };
    // SAFETY: as above.
    unsafe {
        check(libc::fcntl(fd, libc::F_SETOWN, owner))?;
        check(libc::fcntl(fd, F_SETSIG, libc::SIGKILL))?;
        let flags = check(libc::fcntl(fd, libc::F_GETFL))?;
        check(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_ASYNC))?;
    }
    Ok(())
}

/// Writes one byte to the switch `name` in `dir`, which SIGKILLs whoever armed it.
pub(crate) fn fire(dir: &Path, name: &str) -> io::Result<Fired> {
    if name.is_empty() || name.contains('/') {
        return Ok(Fired::NoListener);
    }
    let path = dir.join(format!("{name}{SUFFIX}"));
    let mut fifo = match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        // ENXIO: a FIFO without a reader. ENOENT: removed by its owner as it disarmed.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO) | Some(libc::ENOENT)) => {
            return Ok(Fired::NoListener)
        }
        Err(e) => return Err(e),
    };
    match fifo.write(b"k") {
        Ok(_) => Ok(Fired::Killed),
        // Full of earlier writes: each of them signalled the reader already.
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Fired::Killed),
        // The reader disarmed (let the state dir go, or exited) since the open.
        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => Ok(Fired::NoListener),
        Err(e) => Err(e),
    }
}

/// Removes the switch `name` from `dir`, once its process is gone or proven killed. A live
/// switch cannot be told from a dead one without firing it: opening its write end is
/// harmless, but closing the last writer signals the reader too (fs/pipe.c
/// `pipe_release`), so only switches named by a superseded owner are removed.
pub(crate) fn remove(dir: &Path, name: &str) {
    if !name.is_empty() && !name.contains('/') {
        let _ = std::fs::remove_file(dir.join(format!("{name}{SUFFIX}")));
    }
}
