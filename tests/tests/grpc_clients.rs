//! gRPC clients other than Go's and tonic's on the plugin's unix socket.
//!
//! gRPC's C core (Python grpcio, and so csc-style tools written in Python) sends the
//! socket path, percent-encoded, as `:authority` (grpcio 1.85: `tmp%2Fx%2Fcsi.sock`);
//! grpc-java and grpcurl send the raw path. h2 refuses both (`RST_STREAM` with
//! PROTOCOL_ERROR) unless the plugin replaces them (`server::FixAuthority`).
//!
//! `raw_http2_with_socket_path_authorities` sends those header blocks itself and runs
//! everywhere. `python_grpcio_client` runs grpcio, installed from the package index
//! into a venv kept under the target dir; without the index it skips, loudly, unless
//! FENCECSI_REQUIRE_GRPCIO=1.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fencecsi_driver::config::Mode;
use fencecsi_tests::{require_root, Env, InProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DRIVER: &str = fencecsi_driver::config::DEFAULT_DRIVER_NAME;
/// ControllerServiceCapability.RPC.Type CREATE_DELETE_VOLUME.
const CREATE_DELETE_VOLUME: u64 = 1;
const GET_PLUGIN_INFO: &str = "/csi.v1.Identity/GetPluginInfo";
const CONTROLLER_GET_CAPABILITIES: &str = "/csi.v1.Controller/ControllerGetCapabilities";

// ---- a minimal HTTP/2 client -------------------------------------------------

const HEADERS: u8 = 0x1;
const DATA: u8 = 0x0;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// An HPACK string literal, not Huffman-coded.
fn hpack_string(out: &mut Vec<u8>, s: &str) {
    assert!(s.len() < 127);
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

/// Literal with incremental indexing, new name (as grpcio sends its fields).
fn indexed_literal(out: &mut Vec<u8>, name: &str, value: &str) {
    out.push(0x40);
    hpack_string(out, name);
    hpack_string(out, value);
}

/// Dynamic table index `i` (62 = newest) as an indexed field.
fn indexed(i: u8) -> u8 {
    0x80 | i
}

/// What the server answered on one stream.
#[derive(Debug, Default)]
struct Answer {
    data: Vec<u8>,
    reset: Option<u32>,
    ended: bool,
}

/// Sends `blocks` as unary calls with empty requests on streams 1, 3, 5, ... of one
/// connection; returns each stream's answer.
async fn exchange(socket: &Path, blocks: &[Vec<u8>]) -> Vec<Answer> {
    let mut s = tokio::net::UnixStream::connect(socket)
        .await
        .expect("connect");
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(&mut out, SETTINGS, 0, 0, &[]);
    for (i, block) in blocks.iter().enumerate() {
        let stream = 2 * i as u32 + 1;
        frame(&mut out, HEADERS, END_HEADERS, stream, block);
        // An empty message: not compressed, length 0.
        frame(&mut out, DATA, END_STREAM, stream, &[0; 5]);
    }
    s.write_all(&out).await.unwrap();

    let mut answers: Vec<Answer> = blocks.iter().map(|_| Answer::default()).collect();
    let mut buf = Vec::new();
    let read = async {
        loop {
            while buf.len() >= 9 {
                let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
                if buf.len() < 9 + len {
                    break;
                }
                let (kind, flags) = (buf[3], buf[4]);
                let stream = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) & 0x7fff_ffff;
                let payload = buf[9..9 + len].to_vec();
                buf.drain(..9 + len);
                if kind == SETTINGS && flags & ACK == 0 {
                    let mut ack = Vec::new();
                    frame(&mut ack, SETTINGS, ACK, 0, &[]);
                    s.write_all(&ack).await.unwrap();
                }
                if kind == GOAWAY {
                    panic!(
                        "the server closed the connection: GOAWAY {:?}",
                        &payload[..payload.len().min(8)]
                    );
                }
                if stream == 0 || stream % 2 == 0 {
                    continue;
                }
                let a = &mut answers[(stream as usize - 1) / 2];
                match kind {
                    DATA => a.data.extend_from_slice(&payload),
                    RST_STREAM => {
                        a.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                        a.ended = true;
                    }
                    _ => {}
                }
                if (kind == DATA || kind == HEADERS) && flags & END_STREAM != 0 {
                    a.ended = true;
                }
            }
            if answers.iter().all(|a| a.ended) {
                return;
            }
            let mut chunk = [0u8; 8192];
            let n = s.read(&mut chunk).await.unwrap();
            assert!(
                n > 0,
                "the server closed the connection; so far: {answers:?}"
            );
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    if tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .is_err()
    {
        panic!("the server did not answer in time; so far: {answers:?}");
    }
    answers
}

/// The message of a unary gRPC response body.
fn grpc_message(a: &Answer) -> &[u8] {
    assert!(
        a.reset.is_none(),
        "stream reset by the server with error code {:?} (1 = PROTOCOL_ERROR: h2 refused the request's headers)",
        a.reset
    );
    assert!(a.data.len() >= 5, "no gRPC message: {a:?}");
    assert_eq!(a.data[0], 0, "compressed");
    let len = u32::from_be_bytes(a.data[1..5].try_into().unwrap()) as usize;
    assert_eq!(a.data.len(), 5 + len, "one message");
    &a.data[5..]
}

// ---- enough protobuf to read the two answers ---------------------------------

fn varint(b: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*pos];
        *pos += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            break;
        }
    }
    v
}

/// (field number, value): varints as their value, length-delimited fields as bytes.
fn fields(b: &[u8]) -> Vec<(u64, Result<u64, Vec<u8>>)> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < b.len() {
        let key = varint(b, &mut pos);
        let value = match key & 7 {
            0 => Ok(varint(b, &mut pos)),
            2 => {
                let len = varint(b, &mut pos) as usize;
                pos += len;
                Err(b[pos - len..pos].to_vec())
            }
            t => panic!("wire type {t} not expected here"),
        };
        out.push((key >> 3, value));
    }
    out
}

/// GetPluginInfoResponse.name.
fn plugin_name(msg: &[u8]) -> String {
    fields(msg)
        .into_iter()
        .find_map(|(n, v)| (n == 1).then(|| String::from_utf8(v.unwrap_err()).unwrap()))
        .unwrap_or_default()
}

/// ControllerGetCapabilitiesResponse: the RPC types.
fn controller_capabilities(msg: &[u8]) -> Vec<u64> {
    let mut types = Vec::new();
    for (n, cap) in fields(msg) {
        assert_eq!(n, 1);
        for (n, rpc) in fields(&cap.unwrap_err()) {
            assert_eq!(n, 1);
            for (n, t) in fields(&rpc.unwrap_err()) {
                assert_eq!(n, 1);
                types.push(t.unwrap());
            }
        }
    }
    types
}

/// The header block of a gRPC call; `authority` comes from the caller's bytes.
fn call_block(path: &str, authority: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    indexed_literal(&mut b, ":path", path);
    b.extend_from_slice(authority);
    b.push(0x83); // :method POST (static)
    b.push(0x86); // :scheme http (static)
    indexed_literal(&mut b, "content-type", "application/grpc");
    indexed_literal(&mut b, "te", "trailers");
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_http2_with_socket_path_authorities() {
    require_root!();
    let env = Env::new();
    let (plugin, _c) = InProcess::start(env.config(Mode::Controller, None, "raw")).await;

    // grpcio's form: the path without its leading '/', percent-encoded, as a literal
    // with incremental indexing and a literal name (grpcio 1.85's exact encoding).
    let grpcio = plugin
        .socket
        .to_str()
        .unwrap()
        .trim_start_matches('/')
        .replace('/', "%2F");
    let mut authority = Vec::new();
    indexed_literal(&mut authority, ":authority", &grpcio);
    let first = call_block(GET_PLUGIN_INFO, &authority);
    // The table now holds (newest first) te 62, content-type 63, :authority 64 and
    // :path 65. A second call adds its own :path, then refers to the others by index
    // as grpcio does, the :authority included (now 65).
    let mut second = Vec::new();
    indexed_literal(&mut second, ":path", CONTROLLER_GET_CAPABILITIES);
    second.extend_from_slice(&[indexed(65), 0x83, 0x86, indexed(64), indexed(63)]);
    // grpc-java's and grpcurl's form: the raw path, here a literal without indexing
    // under the static `:authority` name; the first call's :path by index (66).
    let mut third = vec![indexed(66), 0x01];
    hpack_string(&mut third, plugin.socket.to_str().unwrap());
    third.extend_from_slice(&[0x83, 0x86, indexed(64), indexed(63)]);

    let answers = exchange(&plugin.socket, &[first, second, third]).await;
    assert_eq!(plugin_name(grpc_message(&answers[0])), DRIVER);
    let caps = controller_capabilities(grpc_message(&answers[1]));
    assert!(caps.contains(&CREATE_DELETE_VOLUME), "{caps:?}");
    assert_eq!(plugin_name(grpc_message(&answers[2])), DRIVER);

    // A valid authority still works as it did (Go clients send "localhost").
    let mut localhost = Vec::new();
    indexed_literal(&mut localhost, ":authority", "localhost");
    let answers = exchange(&plugin.socket, &[call_block(GET_PLUGIN_INFO, &localhost)]).await;
    assert_eq!(plugin_name(grpc_message(&answers[0])), DRIVER);

    plugin.stop().await;
    env.assert_clean();
}

// ---- Python grpcio -------------------------------------------------------------

/// The grpcio release the test installs (a wheel: no compiler needed).
const GRPCIO_VERSION: &str = "1.85.1";

const CLIENT: &str = r#"
import sys, grpc
sock = sys.argv[1]
print("grpcio", grpc.__version__, file=sys.stderr)
# No options: the channel sends whatever :authority grpcio picks for a unix socket.
with grpc.insecure_channel("unix:" + sock) as ch:
    for method in sys.argv[2:]:
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
    let out = run(
        tokio::process::Command::new(&python)
            .arg(&script)
            .arg(&plugin.socket)
            .args([GET_PLUGIN_INFO, CONTROLLER_GET_CAPABILITIES]),
        Duration::from_secs(60),
    )
    .await
    .unwrap_or_else(|e| panic!("the Python client failed: {e}"));
    let answer = |method: &str| -> Vec<u8> {
        let hex_msg = out
            .lines()
            .find_map(|l| l.strip_prefix(method)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no answer to {method}: {out}"));
        hex::decode(hex_msg.trim()).unwrap()
    };
    assert_eq!(plugin_name(&answer(GET_PLUGIN_INFO)), DRIVER);
    let caps = controller_capabilities(&answer(CONTROLLER_GET_CAPABILITIES));
    assert!(caps.contains(&CREATE_DELETE_VOLUME), "{caps:?}");

    plugin.stop().await;
    env.assert_clean();
}
