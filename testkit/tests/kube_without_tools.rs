//! Without the built tools the fixture fails at once, naming the tool, its
//! version and `cargo xtask install` (no test is silently skipped). Alone in
//! its test binary: it points `RIVET_TOOLS_DIR` at an empty directory.

use rivet_testkit::kube::{KubeApiServer, KubeApiServerError};

#[tokio::test]
async fn kube_api_server_without_tools_says_how_to_install_them() {
    let empty = tempfile::tempdir().expect("temp dir");
    // SAFETY: the only test of this binary; nothing else reads the
    // environment concurrently.
    unsafe { std::env::set_var(rivet_testkit::tools::TOOLS_DIR_ENV, empty.path()) };
    let err = KubeApiServer::start().await.expect_err("no kube-apiserver installed");
    let message = err.to_string();
    assert!(matches!(err, KubeApiServerError::NotInstalled(_)), "{message}");
    assert!(
        message.starts_with("starting kube-apiserver: kube-apiserver (kubernetes v1.34.4) is not installed"),
        "{message}"
    );
    assert!(message.contains("run `cargo xtask install`"), "{message}");
    assert_eq!(
        std::fs::read_dir(empty.path()).expect("read").count(),
        0,
        "the fixture wrote into the tools dir"
    );
}
