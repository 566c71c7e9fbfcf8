//! The cluster's certificates: one CA signs every serving and client
//! certificate (kube-apiserver, the admin, kube-controller-manager,
//! kube-scheduler, kube-apiserver's client to the kubelets, each kubelet's
//! client and serving pair) and the service-account signing key pair.
//! Generated per cluster with rcgen; nothing is read from the machine.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType,
};

use super::KubeClusterError;

/// The CA every certificate of the cluster chains to.
pub(super) struct Pki {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub(super) struct CertFiles {
    /// The PEM certificate.
    pub cert: PathBuf,
    /// The PEM private key.
    pub key: PathBuf,
}

fn cert_err(what: &str) -> impl FnOnce(rcgen::Error) -> KubeClusterError + '_ {
    move |source| KubeClusterError::Certificate {
        what: what.to_owned(),
        source,
    }
}

impl Pki {
    /// Generates the CA into `dir/ca.crt` and the service-account key pair
    /// into `dir/sa.key` and `dir/sa.pub`.
    pub fn create(dir: &Path) -> Result<Self, KubeClusterError> {
        std::fs::create_dir_all(dir).map_err(super::io_err(format!("creating {}", dir.display())))?;
        let ca_key = KeyPair::generate().map_err(cert_err("the CA key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("the CA"))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "rivet-kube-cluster-ca");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = params.self_signed(&ca_key).map_err(cert_err("the CA certificate"))?;
        super::write_file(&dir.join("ca.crt"), &ca.pem())?;
        let sa_key = KeyPair::generate().map_err(cert_err("the service-account signing key"))?;
        super::write_file(&dir.join("sa.key"), &sa_key.serialize_pem())?;
        super::write_file(&dir.join("sa.pub"), &sa_key.public_key_pem())?;
        Ok(Self {
            dir: dir.to_path_buf(),
            issuer: Issuer::new(params, ca_key),
        })
    }

    /// The CA certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The service-account signing key (kube-apiserver and
    /// kube-controller-manager sign tokens with it).
    pub fn sa_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }

    /// Its public half (kube-apiserver verifies tokens with it).
    pub fn sa_pub(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }

    /// A client certificate for user `common_name` in `groups`, as
    /// `<file>.crt` and `<file>.key`.
    pub fn client(&self, file: &str, common_name: &str, groups: &[&str]) -> Result<CertFiles, KubeClusterError> {
        self.leaf(file, common_name, groups, &[], ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// A serving certificate for `names` (DNS names and IP addresses).
    pub fn server(&self, file: &str, common_name: &str, names: &[String]) -> Result<CertFiles, KubeClusterError> {
        self.leaf(file, common_name, &[], names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    fn leaf(
        &self,
        file: &str,
        common_name: &str,
        groups: &[&str],
        names: &[String],
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<CertFiles, KubeClusterError> {
        let what = format!("the certificate {file} ({common_name})");
        let key = KeyPair::generate().map_err(cert_err(&what))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err(&what))?;
        for name in names {
            let san = match name.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(name.clone().try_into().map_err(cert_err(&what))?),
            };
            params.subject_alt_names.push(san);
        }
        params.distinguished_name.push(DnType::CommonName, common_name);
        for group in groups {
            params.distinguished_name.push(DnType::OrganizationName, *group);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.issuer).map_err(cert_err(&what))?;
        let files = CertFiles {
            cert: self.dir.join(format!("{file}.crt")),
            key: self.dir.join(format!("{file}.key")),
        };
        super::write_file(&files.cert, &cert.pem())?;
        super::write_file(&files.key, &key.serialize_pem())?;
        Ok(files)
    }
}

/// A kubeconfig for `server` authenticating with a client certificate.
pub(super) fn kubeconfig(server: &str, ca: &Path, user: &str, cert: &CertFiles) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: rivet\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {cert}\n    \
         client-key: {key}\ncontexts:\n- name: rivet\n  context:\n    cluster: rivet\n    user: {user}\n\
         current-context: rivet\n",
        ca = ca.display(),
        cert = cert.cert.display(),
        key = cert.key.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaf_certificates_carry_their_groups_and_names() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::create(dir.path()).unwrap();
        let node = pki.client("kubelet-n1", "system:node:n1", &["system:nodes"]).unwrap();
        let pem = std::fs::read_to_string(&node.cert).unwrap();
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
        let serving = pki
            .server(
                "apiserver",
                "kube-apiserver",
                &["127.0.0.1".into(), "kubernetes".into()],
            )
            .unwrap();
        assert!(serving.key.exists());
        let config = kubeconfig("https://198.19.254.254:6443", &pki.ca(), "system:node:n1", &node);
        assert!(config.contains("server: https://198.19.254.254:6443"), "{config}");
        assert!(
            config.contains(&format!("client-key: {}", node.key.display())),
            "{config}"
        );
    }
}
