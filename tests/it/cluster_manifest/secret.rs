//! The shared secret: read from the file or the variable the manifest names; refused when
//! missing, empty, short, or (on Unix) in a file its group or others may read or write.

use std::path::Path;

use pipetrain::cluster::ClusterManifest;
use pipetrain::Error;

use super::{edit, GOOD};

const SECRET: &str = "0123456789abcdef0123456789abcdef";

fn with_file(dir: &Path, contents: &[u8], mode: u32) -> ClusterManifest {
    let file = dir.join("cluster.secret");
    // Removed first: the last case may have left it read-only.
    let _ = std::fs::remove_file(&file);
    std::fs::write(&file, contents).unwrap();
    set_mode(&file, mode);
    ClusterManifest::parse(GOOD, &dir.join("cluster.toml")).unwrap()
}

#[cfg(unix)]
fn set_mode(file: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[cfg(not(unix))]
fn set_mode(_: &Path, _: u32) {}

fn with_env() -> ClusterManifest {
    let text = edit(
        GOOD,
        &[(
            "secret_file = \"cluster.secret\"",
            "secret_env = \"PIPETRAIN_SECRET\"",
        )],
    );
    ClusterManifest::parse(&text, Path::new("/jobs/cluster.toml")).unwrap()
}

fn no_env(_: &str) -> Option<String> {
    None
}

/// Reading the secret fails on `field` with a rule containing each of `parts`.
fn refused(m: &ClusterManifest, env: &dyn Fn(&str) -> Option<String>, field: &str, parts: &[&str]) {
    match m.secret(env) {
        Err(Error::Config {
            path,
            field: f,
            rule,
        }) => {
            assert_eq!((path.as_path(), f.as_str()), (m.path(), field), "{rule}");
            for p in parts {
                assert!(rule.contains(p), "`{rule}` lacks `{p}`");
            }
        }
        other => panic!("expected an error on {field}, got {other:?}"),
    }
}

#[test]
fn the_secret_comes_from_the_file_beside_the_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let m = with_file(dir.path(), format!("{SECRET}\n").as_bytes(), 0o600);
    assert_eq!(m.secret(&no_env).unwrap(), SECRET.as_bytes());
    // One trailing newline goes (either convention); other bytes are the secret's.
    let m = with_file(dir.path(), format!("{SECRET}\r\n").as_bytes(), 0o400);
    assert_eq!(m.secret(&no_env).unwrap(), SECRET.as_bytes());
    let m = with_file(dir.path(), format!(" {SECRET}\n\n").as_bytes(), 0o600);
    assert_eq!(
        m.secret(&no_env).unwrap(),
        format!(" {SECRET}\n").as_bytes()
    );
}

#[test]
fn the_secret_comes_from_the_named_variable() {
    let m = with_env();
    let env = |k: &str| (k == "PIPETRAIN_SECRET").then(|| SECRET.to_string());
    assert_eq!(m.secret(&env).unwrap(), SECRET.as_bytes());
}

#[test]
fn missing_empty_or_short_secrets_say_where_they_looked() {
    let dir = tempfile::tempdir().unwrap();
    let m = ClusterManifest::parse(GOOD, &dir.path().join("cluster.toml")).unwrap();
    let where_ = dir.path().join("cluster.secret").display().to_string();
    refused(
        &m,
        &no_env,
        "job.secret_file",
        &["cannot read the secret file", &where_],
    );
    let m = with_file(dir.path(), b"\n", 0o600);
    refused(&m, &no_env, "job.secret_file", &[&where_, "is empty"]);
    let m = with_file(dir.path(), b"hunter2", 0o600);
    refused(
        &m,
        &no_env,
        "job.secret_file",
        &["has 7 bytes", "at least 16"],
    );
    let m = with_env();
    refused(
        &m,
        &no_env,
        "job.secret_env",
        &["PIPETRAIN_SECRET is not set"],
    );
    refused(
        &m,
        &|_| Some(String::new()),
        "job.secret_env",
        &["environment variable PIPETRAIN_SECRET is empty"],
    );
}

#[cfg(unix)]
#[test]
fn secret_files_others_may_read_or_write_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
        let m = with_file(dir.path(), SECRET.as_bytes(), mode);
        refused(
            &m,
            &no_env,
            "job.secret_file",
            &[&format!("mode {mode:04o}"), "chmod 600"],
        );
    }
    for mode in [0o600, 0o400, 0o700] {
        let m = with_file(dir.path(), SECRET.as_bytes(), mode);
        assert_eq!(
            m.secret(&no_env).unwrap(),
            SECRET.as_bytes(),
            "mode {mode:o}"
        );
    }
}
