//! `--target org/name[@revision]` downloads into the Hugging Face cache: against a tiny
//! hub this test serves on 127.0.0.1, speaking the endpoints and headers the hub's
//! clients use (the revision API, ranged file GETs with etag and x-repo-commit).

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

use dspec_engine::tiny_model::write_tiny_model;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// One request the hub saw.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    range: Option<String>,
    authorization: Option<String>,
}

/// A hub serving one repo, `org/tiny`, at revisions `main` and `v1`.
struct Hub {
    addr: String,
    files: Arc<BTreeMap<String, Vec<u8>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    _dir: tempfile::TempDir,
}

fn etag(bytes: &[u8]) -> String {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}{}", h.finish(), bytes.len())
}

impl Hub {
    fn start() -> Hub {
        let dir = tempfile::tempdir().expect("temp dir");
        write_tiny_model(dir.path(), "{}", 3).expect("tiny model");
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir.path()).expect("model dir") {
            let path = entry.expect("entry").path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            files.insert(name, std::fs::read(&path).expect("model file"));
        }
        // What a hub repo holds besides: dspec must leave these alone.
        files.insert("README.md".into(), b"# tiny".to_vec());
        files.insert("pytorch_model.bin".into(), vec![0; 64]);
        let files = Arc::new(files);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (f, s) = (files.clone(), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let (f, s) = (f.clone(), s.clone());
                std::thread::spawn(move || answer(stream, &f, &s));
            }
        });
        Hub {
            addr,
            files,
            seen,
            _dir: dir,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// `dspec generate` on `target` with the hub as endpoint and `home` as HF_HOME.
    fn generate(&self, home: &Path, target: &str, env: &[(&str, &str)]) -> Output {
        let mut command = Command::new(env!("CARGO_BIN_EXE_dspec"));
        command
            .args(["generate", "--target", target, "--prompt", "hi"])
            .args(["--max-tokens", "3", "--json"])
            .env("HF_HOME", home)
            .env("HF_ENDPOINT", format!("http://{}", self.addr))
            .env_remove("HF_TOKEN")
            .env_remove("HF_HUB_OFFLINE");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().expect("run dspec")
    }
}

fn answer(mut stream: TcpStream, files: &BTreeMap<String, Vec<u8>>, seen: &Mutex<Vec<Seen>>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    seen.lock().unwrap().push(Seen {
        path: path.clone(),
        range: headers.get("range").cloned(),
        authorization: headers.get("authorization").cloned(),
    });
    let revision_ok = |rev: &str| rev == "main" || rev == "v1" || rev == COMMIT;
    let mut extra = Vec::new();
    let (status, body): (&str, Vec<u8>) = if let Some(rev) =
        path.strip_prefix("/api/models/org/tiny/revision/")
    {
        if revision_ok(rev) {
            let siblings: Vec<_> = files
                .keys()
                .map(|name| serde_json::json!({"rfilename": name}))
                .collect();
            let info = serde_json::json!({"id": "org/tiny", "sha": COMMIT, "siblings": siblings});
            ("200 OK", info.to_string().into_bytes())
        } else {
            (
                "404 Not Found",
                b"{\"error\":\"Revision Not Found\"}".to_vec(),
            )
        }
    } else if let Some(rest) = path.strip_prefix("/org/tiny/resolve/") {
        let (rev, name) = rest.split_once('/').unwrap_or((rest, ""));
        match files.get(name).filter(|_| revision_ok(rev)) {
            None => ("404 Not Found", b"{\"error\":\"Entry not found\"}".to_vec()),
            Some(bytes) => {
                extra.push(format!("ETag: \"{}\"", etag(bytes)));
                extra.push(format!("X-Repo-Commit: {COMMIT}"));
                extra.push("Accept-Ranges: bytes".into());
                let range = headers
                    .get("range")
                    .and_then(|r| r.strip_prefix("bytes="))
                    .and_then(|r| r.split_once('-'))
                    .and_then(|(a, b)| {
                        let start: usize = a.parse().ok()?;
                        let end = if b.is_empty() {
                            bytes.len().saturating_sub(1)
                        } else {
                            b.parse::<usize>().ok()?.min(bytes.len() - 1)
                        };
                        Some((start, end))
                    });
                match range {
                    Some((start, end)) if start <= end && end < bytes.len() => {
                        extra.push(format!(
                            "Content-Range: bytes {start}-{end}/{}",
                            bytes.len()
                        ));
                        ("206 Partial Content", bytes[start..=end].to_vec())
                    }
                    _ => ("200 OK", bytes.clone()),
                }
            }
        }
    } else {
        ("404 Not Found", b"{}".to_vec())
    };
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for h in extra {
        head.push_str(&h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    if method != "HEAD" {
        let _ = stream.write_all(&body);
    }
}

fn snapshot(home: &Path) -> PathBuf {
    home.join("hub/models--org--tiny/snapshots").join(COMMIT)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[test]
fn a_hub_id_downloads_only_what_dspec_reads_then_runs_from_the_cache() {
    let hub = Hub::start();
    let home = tempfile::tempdir().expect("HF_HOME");
    let out = hub.generate(home.path(), "org/tiny", &[("HF_TOKEN", "secret")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json output");
    assert!(json["stats"]["generated_tokens"].as_u64().unwrap() > 0);

    let snapshot = snapshot(home.path());
    for (name, bytes) in hub.files.iter() {
        let cached = snapshot.join(name);
        if name == "README.md" || name == "pytorch_model.bin" {
            assert!(!cached.exists(), "{name} was downloaded");
        } else {
            assert_eq!(&std::fs::read(&cached).expect(name), bytes, "{name}");
        }
    }
    let seen = hub.seen();
    assert!(seen
        .iter()
        .all(|s| !s.path.contains("README") && !s.path.contains(".bin")));
    assert!(
        seen.iter()
            .all(|s| s.authorization.as_deref() == Some("Bearer secret")),
        "HF_TOKEN is sent: {seen:?}"
    );

    // Offline, the cache is enough; the hub hears nothing more.
    let before = hub.seen().len();
    let out = hub.generate(home.path(), "org/tiny", &[("HF_HUB_OFFLINE", "1")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(hub.seen().len(), before);
}

#[test]
fn offline_without_a_cache_names_what_is_missing_and_asks_nothing() {
    let hub = Hub::start();
    let home = tempfile::tempdir().expect("HF_HOME");
    let out = hub.generate(home.path(), "org/tiny", &[("HF_HUB_OFFLINE", "1")]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("HF_HUB_OFFLINE") && err.contains("config.json") && err.contains("org/tiny"),
        "{err}"
    );
    assert!(hub.seen().is_empty(), "{:?}", hub.seen());
}

#[test]
fn a_revision_is_fetched_and_an_unknown_one_is_a_clear_error() {
    let hub = Hub::start();
    let home = tempfile::tempdir().expect("HF_HOME");
    let out = hub.generate(home.path(), "org/tiny@v1", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(snapshot(home.path()).join("config.json").exists());
    assert!(hub
        .seen()
        .iter()
        .any(|s| s.path == "/org/tiny/resolve/v1/config.json"));

    let out = hub.generate(home.path(), "org/tiny@nope", &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("org/tiny@nope") && err.contains("revision"),
        "{err}"
    );
}

#[test]
fn an_interrupted_download_resumes_where_it_stopped() {
    let hub = Hub::start();
    let home = tempfile::tempdir().expect("HF_HOME");
    let weights = &hub.files["model.safetensors"];
    let half = weights.len() / 2;
    // What an interrupted download leaves: the blob's first half, named as in progress.
    let blobs = home.path().join("hub/models--org--tiny/blobs");
    std::fs::create_dir_all(&blobs).expect("blobs dir");
    std::fs::write(
        blobs.join(format!("{}.part", etag(weights))),
        &weights[..half],
    )
    .expect("partial blob");
    let out = hub.generate(home.path(), "org/tiny", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        &std::fs::read(snapshot(home.path()).join("model.safetensors")).expect("weights"),
        weights
    );
    let resumed = format!("bytes={half}-");
    assert!(
        hub.seen()
            .iter()
            .any(|s| s.path.ends_with("/model.safetensors")
                && s.range.as_deref() == Some(resumed.as_str())),
        "{:?}",
        hub.seen()
    );
}
