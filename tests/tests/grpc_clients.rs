//! gRPC clients other than Go's and tonic's on the plugin's unix socket.
//!
//! gRPC's C core (Python grpcio, and so csc-style tools written in Python) sends the
//! socket path, percent-encoded, as `:authority` (grpcio 1.85: `tmp%2Fx%2Fcsi.sock`),
//! which is not a URI authority: h2, under tonic, refuses the call with
//! `RST_STREAM(PROTOCOL_ERROR)`. Such clients set the channel option
//! `grpc.default_authority` (docs/grpc-clients.md); Go clients (kubelet, the sidecars,
//! csi-sanity, csc, grpcurl) send `localhost` and need nothing.
//!
//! `python_grpcio_client` runs grpcio, installed from the package index into a venv
//! kept under the target dir, with and without the option; without the index it
//! skips, loudly, unless FENCECSI_REQUIRE_GRPCIO=1.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fencecsi_driver::config::Mode;
use fencecsi_proto::v1::controller_service_capability::{rpc, Type};
use fencecsi_proto::v1::{ControllerGetCapabilitiesResponse, GetPluginInfoResponse};
use fencecsi_tests::{require_root, Env, InProcess};
use prost::Message;

const DRIVER: &str = fencecsi_driver::config::DEFAULT_DRIVER_NAME;
const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";

/// The grpcio release the test installs (a wheel: no compiler needed).
const GRPCIO_VERSION: &str = "1.85.1";

const CLIENT: &str = r#"
import sys, grpc
sock = sys.argv[1]
print("grpcio", grpc.__version__, file=sys.stderr)
# With "default": no options, so the channel sends whatever :authority grpcio picks
# for a unix socket; with "localhost": the option docs/grpc-clients.md gives.
opts = [] if sys.argv[2] == "default" else [("grpc.default_authority", sys.argv[2])]
with grpc.insecure_channel("unix:" + sock, options=opts) as ch:
    for method in sys.argv[3:]:
        call = ch.unary_unary(method)  # bytes in, bytes out
        try:
            print(method, call(b"", timeout=20).hex(), flush=True)
        except grpc.RpcError as e:
            print("FAILED", method, e.code(), e.details(), file=sys.stderr)
            sys.exit(1)
"#;

/// Whether a failed install fails the test (else it is skipped).
fn grpcio_required() -> bool {
    std::env::var("FENCECSI_REQUIRE_GRPCIO").is_ok_and(|v| v == "1")
}

async fn run(cmd: &mut tokio::process::Command, limit: Duration) -> Result<String, String> {
    let what = format!("{:?}", cmd.as_std());
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("{what}: {e}"))?;
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .map_err(|_| format!("{what}: still running after {limit:?}"))?
        .map_err(|e| format!("{what}: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{what}: {}\n{stderr}", out.status));
    }
    if !stderr.trim().is_empty() {
        eprintln!("{stderr}");
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A python with grpcio: a venv under the target dir, made once per grpcio and
/// Python version (a marker file says it is complete).
async fn grpcio_python() -> Result<PathBuf, String> {
    let version = run(
        tokio::process::Command::new("python3")
            .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"]),
        Duration::from_secs(30),
    )
    .await?;
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("grpcio-{GRPCIO_VERSION}-py{}", version.trim()));
    let python = venv.join("bin/python");
    let done = venv.join("fencecsi-installed");
    if done.exists() {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&venv);
    eprintln!(
        "making {} (pip install grpcio=={GRPCIO_VERSION})",
        venv.display()
    );
    run(
        tokio::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv),
        Duration::from_secs(60),
    )
    .await?;
    run(
        tokio::process::Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            "--only-binary=:all:",
            &format!("grpcio=={GRPCIO_VERSION}"),
        ]),
        Duration::from_secs(240),
    )
    .await?;
    std::fs::write(&done, b"").map_err(|e| e.to_string())?;
    Ok(python)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_client() {
    require_root!();
    let python = match grpcio_python().await {
        Ok(p) => p,
        Err(e) => {
            let msg = format!(
                "\n==== grpcio NOT TESTED: cannot make a venv with grpcio {GRPCIO_VERSION} ====\n{e}\n\
                 (set FENCECSI_REQUIRE_GRPCIO=1 to make this a failure)\n"
            );
            if grpcio_required() {
                panic!("{msg}");
            }
            eprintln!("{msg}");
            return;
        }
    };
    let env = Env::new();
    let (plugin, _c) = InProcess::start(env.config(Mode::Controller, None, "py")).await;
    let script = env.path().join("client.py");
    std::fs::write(&script, CLIENT).unwrap();
    let client = |authority: &'static str| {
        let mut cmd = tokio::process::Command::new(&python);
        cmd.arg(&script)
            .arg(&plugin.socket)
            .arg(authority)
            .args([GET_PLUGIN_INFO, CONTROLLER_GET_CAPABILITIES]);
        cmd
    };

    // With the option the docs give, both services answer.
    let out = run(&mut client("localhost"), Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("the Python client with grpc.default_authority failed: {e}"));
    let answer = |method: &str| -> Vec<u8> {
        let hex_msg = out
            .lines()
            .find_map(|l| l.strip_prefix(method)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no answer to {method}: {out}"));
        hex::decode(hex_msg.trim()).unwrap()
    };
    let info = GetPluginInfoResponse::decode(answer(GET_PLUGIN_INFO).as_slice()).unwrap();
    assert_eq!(info.name, DRIVER);
    let caps =
        ControllerGetCapabilitiesResponse::decode(answer(CONTROLLER_GET_CAPABILITIES).as_slice())
            .unwrap();
    let create_delete = caps.capabilities.iter().any(|c| {
        matches!(&c.r#type, Some(Type::Rpc(r)) if r.r#type == rpc::Type::CreateDeleteVolume as i32)
    });
    assert!(create_delete, "{caps:?}");

    // Without it, grpcio's own :authority is refused: why the docs ask for the option.
    // (Should a later h2 or grpcio make this pass, docs/grpc-clients.md needs updating.)
    let refused = run(&mut client("default"), Duration::from_secs(60))
        .await
        .expect_err("grpcio without grpc.default_authority was expected to be refused");
    eprintln!("without the option, as expected: {refused}");
    // RST_STREAM with error code 1 (PROTOCOL_ERROR): h2 refusing the header block.
    assert!(
        refused.contains("FAILED /csi.v1.Identity/GetPluginInfo")
            && refused.contains("RST_STREAM with error code 1"),
        "{refused}"
    );

    plugin.stop().await;
    env.assert_clean();
}
