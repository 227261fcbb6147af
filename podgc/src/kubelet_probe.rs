//! The second signal of the fast path: does the node's kubelet still answer a TLS
//! handshake on its serving port?
//!
//! What an answer proves: a process on that node is running, reachable from podgc, and
//! gets CPU. A frozen kubelet cannot answer (the kernel completes the TCP handshake from
//! its listen backlog, but the ClientHello then sits unread), a dead node or a partitioned
//! one does not answer at all, and a stopped kubelet refuses the connection. A node plugin
//! that crashed or is being rolled leaves the kubelet answering, and so does an API server
//! that is slow or restarting: neither makes a node look down here.
//!
//! The probe asks only whether a process answers, not who it is: the kubelet's serving
//! certificate is often self-signed, and a certificate check would add nothing to a
//! liveness signal. So the client accepts any certificate and checks no signature. It
//! sends no client certificate and no request; any TLS record from the server (a finished
//! handshake, or an alert because the kubelet wants something the probe does not send)
//! counts as an answer. Only silence until the bound, a refused or unreachable
//! connection, or a connection closed before any TLS record count as no answer.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Why a kubelet did not answer.
#[derive(Debug, thiserror::Error)]
pub enum NoAnswer {
    #[error("no TCP connection: {0}")]
    Connect(std::io::Error),
    #[error("no TLS answer within {0:?}")]
    Silent(Duration),
    #[error("the connection ended before any TLS record: {0}")]
    Closed(std::io::Error),
}

/// How the kubelet answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The handshake finished.
    Handshake,
    /// It answered with a TLS alert or a record the probe did not accept.
    Refused(String),
}

/// Probes `addr` once; the whole probe (connect and handshake) is bounded by `bound`.
pub async fn probe_kubelet(addr: SocketAddr, bound: Duration) -> Result<Answer, NoAnswer> {
    match tokio::time::timeout(bound, handshake(addr)).await {
        Ok(r) => r,
        Err(_) => Err(NoAnswer::Silent(bound)),
    }
}

async fn handshake(addr: SocketAddr) -> Result<Answer, NoAnswer> {
    let tcp = TcpStream::connect(addr).await.map_err(NoAnswer::Connect)?;
    let name = ServerName::IpAddress(addr.ip().into());
    match TlsConnector::from(client_config()).connect(name, tcp).await {
        Ok(_) => Ok(Answer::Handshake),
        // tokio-rustls hands rustls' own errors (an alert received, a record it could not
        // take) through as InvalidData: the server sent something.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Ok(Answer::Refused(e.to_string())),
        Err(e) => Err(NoAnswer::Closed(e)),
    }
}

fn client_config() -> Arc<ClientConfig> {
    static CONFIG: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let cfg = ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .expect("ring supports the default protocol versions")
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
                .with_no_client_auth();
            Arc::new(cfg)
        })
        .clone()
}

/// Accepts every certificate and signature: the probe is a liveness signal (module docs).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
