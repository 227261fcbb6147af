//! A kubelet's serving port as podgc's probe sees it: `openssl s_server` on loopback with a
//! fresh self-signed certificate. A real process, so freezing it (SIGSTOP) leaves what a
//! frozen kubelet leaves: a socket the kernel still accepts connections on, and no TLS
//! answer. Killed and reaped on drop.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub struct KubeletTls {
    child: Child,
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

fn openssl(args: &[&str], dir: &Path) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (scripts/setup.sh installs it)");
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

impl KubeletTls {
    /// Starts the server and waits until it listens.
    pub fn start() -> KubeletTls {
        let dir = tempfile::tempdir().unwrap();
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                "key.pem",
                "-out",
                "cert.pem",
                "-subj",
                "/CN=kubelet",
                "-days",
                "1",
            ],
            dir.path(),
        );
        let log = std::fs::File::create(dir.path().join("out")).unwrap();
        // Port 0: the kernel picks a free one, and s_server prints it ("ACCEPT ip:port").
        // -www: it serves each connection on its own and never reads stdin (in its plain
        // mode, stdin at EOF ends every session before the handshake).
        let child = Command::new("openssl")
            .args([
                "s_server",
                "-www",
                "-accept",
                "127.0.0.1:0",
                "-cert",
                "cert.pem",
                "-key",
                "key.pem",
            ])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .expect("openssl s_server");
        let mut me = KubeletTls {
            child,
            addr: "127.0.0.1:0".parse().unwrap(),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = std::fs::read_to_string(me._dir.path().join("out")).unwrap_or_default();
            if let Some(a) = out
                .lines()
                .find_map(|l| l.strip_prefix("ACCEPT "))
                .and_then(|a| a.trim().parse().ok())
            {
                me.addr = a;
                return me;
            }
            assert!(Instant::now() < deadline, "s_server did not listen: {out}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, s: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), s).unwrap();
    }

    /// Freezes the process (SIGSTOP), as a frozen cgroup would.
    pub fn freeze(&self) {
        self.signal(Signal::SIGSTOP);
    }

    pub fn thaw(&self) {
        self.signal(Signal::SIGCONT);
    }
}

impl Drop for KubeletTls {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
