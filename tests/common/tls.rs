//! Throwaway TLS material for the TLS tests (feature `tls`): a CA and a server certificate for
//! `localhost` and `127.0.0.1` that it signed, generated per run with rcgen and written to a temp
//! dir for `redis-server`.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use super::TempDir;

/// A CA certificate (PEM) and the issuer to sign with.
pub fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A certificate for `names` signed by `ca`: (certificate PEM, key PEM).
pub fn leaf(ca: &CertifiedIssuer<'static, KeyPair>, names: &[&str], cn: &str) -> (String, String) {
    let mut p =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    p.distinguished_name.push(DnType::CommonName, cn);
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, ca).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A fresh CA and a server certificate and key it signed (for `localhost` and `127.0.0.1`), as
/// files; removed on drop.
#[derive(Debug)]
pub struct ServerCerts {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// The CA certificate, for the client's `tls_root_cert`.
    pub ca_pem: Vec<u8>,
    _dir: TempDir,
}

impl ServerCerts {
    pub fn new() -> ServerCerts {
        let dir = TempDir::new("tls");
        let ca = new_ca("dlock test CA");
        let (leaf_cert, leaf_key) = leaf(&ca, &["localhost", "127.0.0.1"], "dlock test server");
        let certs = ServerCerts {
            cert: dir.path().join("server.crt"),
            key: dir.path().join("server.key"),
            ca: dir.path().join("ca.crt"),
            ca_pem: ca.pem().into_bytes(),
            _dir: dir,
        };
        std::fs::write(&certs.cert, leaf_cert).unwrap();
        std::fs::write(&certs.key, leaf_key).unwrap();
        std::fs::write(&certs.ca, &certs.ca_pem).unwrap();
        certs
    }

    /// `redis-server` arguments that serve TLS with these files (on a `--tls-port` the caller
    /// adds); clients need no certificate of their own.
    pub fn redis_args(&self) -> Vec<String> {
        let path = |p: &PathBuf| p.to_str().expect("a UTF-8 temp path").to_string();
        vec![
            "--tls-cert-file".into(),
            path(&self.cert),
            "--tls-key-file".into(),
            path(&self.key),
            "--tls-ca-cert-file".into(),
            path(&self.ca),
            "--tls-auth-clients".into(),
            "no".into(),
        ]
    }
}
