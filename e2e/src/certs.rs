//! The cluster's PKI, made with the openssl command line: a CA, the API server's serving
//! certificate (with the `kubernetes` Service IP among its names, since pods reach it
//! there), the API server's client certificate for kubelets, and the service-account
//! signing key.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

use crate::process::run;

pub struct Pki {
    pub ca_cert: PathBuf,
    pub ca_key: PathBuf,
    pub apiserver_cert: PathBuf,
    pub apiserver_key: PathBuf,
    pub kubelet_client_cert: PathBuf,
    pub kubelet_client_key: PathBuf,
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
}

/// Makes every key and certificate under `dir`. `ips` and `dns` are the API server's
/// subject alternative names.
pub fn make(dir: &Path, ips: &[&str], dns: &[&str]) -> Result<Pki> {
    std::fs::create_dir_all(dir)?;
    let p = |n: &str| dir.join(n);
    let pki = Pki {
        ca_cert: p("ca.crt"),
        ca_key: p("ca.key"),
        apiserver_cert: p("apiserver.crt"),
        apiserver_key: p("apiserver.key"),
        kubelet_client_cert: p("apiserver-kubelet-client.crt"),
        kubelet_client_key: p("apiserver-kubelet-client.key"),
        sa_key: p("sa.key"),
        sa_pub: p("sa.pub"),
    };
    ec_key(&pki.ca_key)?;
    run(Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-new",
            "-sha256",
            "-days",
            "2",
            "-subj",
            "/CN=fencecsi-e2e-ca",
        ])
        .arg("-key")
        .arg(&pki.ca_key)
        .arg("-out")
        .arg(&pki.ca_cert)
        .args(["-addext", "basicConstraints=critical,CA:TRUE"])
        .args([
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        ]))?;
    let mut sans: Vec<String> = ips.iter().map(|i| format!("IP:{i}")).collect();
    sans.extend(dns.iter().map(|d| format!("DNS:{d}")));
    signed(
        &pki,
        &pki.apiserver_key,
        &pki.apiserver_cert,
        "/CN=kube-apiserver",
        &format!(
            "subjectAltName={}\nextendedKeyUsage=serverAuth",
            sans.join(",")
        ),
        dir,
    )?;
    signed(
        &pki,
        &pki.kubelet_client_key,
        &pki.kubelet_client_cert,
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
        "extendedKeyUsage=clientAuth",
        dir,
    )?;
    ec_key(&pki.sa_key)?;
    run(Command::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(&pki.sa_key)
        .arg("-out")
        .arg(&pki.sa_pub))?;
    Ok(pki)
}

fn ec_key(path: &Path) -> Result<()> {
    run(Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
        ])
        .arg(path))?;
    Ok(())
}

fn signed(pki: &Pki, key: &Path, cert: &Path, subj: &str, ext: &str, dir: &Path) -> Result<()> {
    ec_key(key)?;
    let csr = cert.with_extension("csr");
    let extfile = cert.with_extension("ext");
    std::fs::write(
        &extfile,
        format!("{ext}\nkeyUsage=critical,digitalSignature,keyEncipherment\n"),
    )?;
    run(Command::new("openssl")
        .args(["req", "-new", "-subj", subj, "-key"])
        .arg(key)
        .arg("-out")
        .arg(&csr))?;
    run(Command::new("openssl")
        .args(["x509", "-req", "-sha256", "-days", "2", "-in"])
        .arg(&csr)
        .arg("-CA")
        .arg(&pki.ca_cert)
        .arg("-CAkey")
        .arg(&pki.ca_key)
        .arg("-CAcreateserial")
        .arg("-CAserial")
        .arg(dir.join("ca.srl"))
        .arg("-extfile")
        .arg(&extfile)
        .arg("-out")
        .arg(cert))?;
    Ok(())
}
