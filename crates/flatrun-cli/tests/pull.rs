//! `flatrun pull` against a mock hub on 127.0.0.1: the cache layout, a
//! quantization picked by name, SafeTensors repos as a directory, resume
//! after an interrupted transfer, the hub id check, and the errors (missing
//! repo, missing quant, no network, full disk). Also `--model REPO:QUANT`
//! resolved from the cache.
#![cfg(feature = "hub")]

mod common;
#[path = "common/mock_hub.rs"]
mod mock_hub;
#[path = "common/tmux.rs"]
mod tmux;

use common::flatrun;
use mock_hub::{COMMIT, MockFile, MockHub, bytes};
use std::path::{Path, PathBuf};

const GGUF_REPO: &str = "test/tiny-GGUF";
const MIB: usize = 1 << 20;

fn gguf_repo(q4: MockFile) -> (String, Vec<MockFile>) {
    (
        GGUF_REPO.to_string(),
        vec![
            MockFile::git(".gitattributes", b"*.gguf filter=lfs\n".to_vec()),
            MockFile::git("README.md", b"# tiny\n".to_vec()),
            q4,
            MockFile::lfs("tiny-q8_0.gguf", bytes(MIB, 2)),
        ],
    )
}

fn q4(data: Vec<u8>) -> MockFile {
    MockFile::lfs("tiny-q4_k_m.gguf", data)
}

/// `flatrun pull ARGS` with the hub at `endpoint` and the cache in `home`.
fn pull(endpoint: &str, home: &Path, args: &[&str]) -> assert_cmd::assert::Assert {
    flatrun()
        .arg("pull")
        .args(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .assert()
}

fn stdout(assert: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&assert.get_output().stdout)
        .trim()
        .to_string()
}

fn stderr(assert: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&assert.get_output().stderr).to_string()
}

fn repo_dir(home: &Path, repo: &str) -> PathBuf {
    home.join("hub")
        .join(format!("models--{}", repo.replace('/', "--")))
}

#[test]
fn pulls_a_quant_into_the_hub_cache_and_reuses_it() {
    let data = bytes(2 * MIB + 123, 1);
    let hub = MockHub::start(vec![gguf_repo(q4(data.clone()))]);
    let home = tempfile::tempdir().unwrap();
    let first = pull(
        &hub.endpoint,
        home.path(),
        &[&format!("{GGUF_REPO}:Q4_K_M")],
    )
    .success();
    let path = PathBuf::from(stdout(&first));
    let dir = repo_dir(home.path(), GGUF_REPO);
    assert_eq!(
        path,
        dir.join("snapshots").join(COMMIT).join("tiny-q4_k_m.gguf")
    );
    assert_eq!(std::fs::read(&path).unwrap(), data);
    // The snapshot file links to a blob named by its sha256, as the hub's
    // own tools lay it out; `refs/main` names the commit.
    let blob = std::fs::canonicalize(&path).unwrap();
    assert_eq!(
        blob.parent().unwrap(),
        dir.join("blobs").canonicalize().unwrap()
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("refs/main")).unwrap(),
        COMMIT
    );
    // Piped: the final line only, no redraws.
    let err = stderr(&first);
    assert!(!err.contains('\r'), "{err:?}");
    assert!(
        err.contains("tiny-q4_k_m.gguf: 2.0 MiB of 2.0 MiB"),
        "{err}"
    );
    assert!(
        !dir.join("snapshots")
            .join(COMMIT)
            .join("README.md")
            .exists()
    );
    assert!(hub.requests("tiny-q8_0").is_empty());

    // Again: nothing is fetched.
    let resolves = hub.requests("/resolve/").len();
    let again = pull(
        &hub.endpoint,
        home.path(),
        &[&format!("{GGUF_REPO}:q4_k_m")],
    )
    .success();
    assert!(stderr(&again).contains("already in the cache"));
    assert_eq!(hub.requests("/resolve/").len(), resolves);

    // --model REPO:QUANT resolves from the cache (the fixture is no real
    // GGUF, so loading then fails naming the resolved file).
    let run = flatrun()
        .args([
            "tokenize",
            "--model",
            &format!("{GGUF_REPO}:Q4_K_M"),
            "--text",
            "hi",
        ])
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .assert()
        .failure();
    assert!(
        stderr(&run).contains(path.to_str().unwrap()),
        "{}",
        stderr(&run)
    );
    let missing = flatrun()
        .args([
            "tokenize",
            "--model",
            &format!("{GGUF_REPO}:Q5_K_M"),
            "--text",
            "hi",
        ])
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .assert()
        .failure();
    let err = stderr(&missing);
    assert!(
        err.starts_with("error: model not found") && err.contains("has no Q5_K_M"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 2, "{err}");
    assert_eq!(missing.get_output().status.code(), Some(1));
    let absent = flatrun()
        .args(["tokenize", "--model", "other/repo:Q4_K_M", "--text", "hi"])
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .assert()
        .failure();
    let err = stderr(&absent);
    assert!(
        err.contains("not in the cache") && err.contains("flatrun pull other/repo:Q4_K_M"),
        "{err}"
    );
}

#[test]
fn sends_hf_token_and_honours_hf_hub_cache() {
    let hub = MockHub::start(vec![gguf_repo(q4(bytes(1000, 3)))]);
    let cache = tempfile::tempdir().unwrap();
    let out = flatrun()
        .args(["pull", &format!("{GGUF_REPO}:Q4_K_M")])
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HUB_CACHE", cache.path())
        .env("HF_TOKEN", "hf_secret")
        .assert()
        .success();
    assert!(stdout(&out).starts_with(cache.path().to_str().unwrap()));
    let seen = hub.requests("/api/models/");
    assert_eq!(seen[0].authorization.as_deref(), Some("Bearer hf_secret"));
}

#[test]
fn pulls_a_safetensors_repo_as_a_directory() {
    let repo = "test/tiny-st";
    let hub = MockHub::start(vec![(
        repo.to_string(),
        vec![
            MockFile::git(".gitattributes", b"*.safetensors filter=lfs\n".to_vec()),
            MockFile::git("README.md", b"# st\n".to_vec()),
            MockFile::git("config.json", b"{\"model_type\":\"llama\"}".to_vec()),
            MockFile::git("tokenizer.json", b"{}".to_vec()),
            MockFile::lfs("model.safetensors", bytes(300_000, 4)),
        ],
    )]);
    let home = tempfile::tempdir().unwrap();
    let out = pull(&hub.endpoint, home.path(), &[repo]).success();
    let dir = PathBuf::from(stdout(&out));
    assert_eq!(
        dir,
        repo_dir(home.path(), repo).join("snapshots").join(COMMIT)
    );
    for file in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(dir.join(file).is_file(), "{file}");
    }
    assert!(!dir.join("README.md").exists());
}

#[test]
fn resumes_an_interrupted_download() {
    let data = bytes(3 * MIB, 5);
    let hub = MockHub::start(vec![gguf_repo(q4(data.clone()).cut(1))]);
    let home = tempfile::tempdir().unwrap();
    let spec = format!("{GGUF_REPO}:Q4_K_M");
    let first = pull(&hub.endpoint, home.path(), &[&spec, "--retries", "0"]).failure();
    let err = stderr(&first);
    assert!(err.contains("closed before the end"), "{err}");
    let dir = repo_dir(home.path(), GGUF_REPO);
    let id = mock_hub::hex(&<sha2::Sha256 as sha2::Digest>::digest(&data));
    let part = dir.join("blobs").join(format!("{id}.part"));
    let kept = std::fs::metadata(&part).expect("the .part stays").len();
    assert!(kept > 0 && kept < data.len() as u64, "{kept}");
    // Nothing under the final names.
    assert!(!dir.join("blobs").join(&id).exists());
    assert!(
        !dir.join("snapshots")
            .join(COMMIT)
            .join("tiny-q4_k_m.gguf")
            .exists()
    );

    let second = pull(&hub.endpoint, home.path(), &[&spec]).success();
    let ranges: Vec<String> = hub
        .requests("tiny-q4_k_m")
        .into_iter()
        .filter_map(|s| s.range)
        .collect();
    assert!(ranges.contains(&format!("bytes={kept}-")), "{ranges:?}");
    assert!(
        stderr(&second).contains("resumed at"),
        "{}",
        stderr(&second)
    );
    assert_eq!(std::fs::read(stdout(&second)).unwrap(), data);
}

#[test]
fn retries_a_dropped_connection_within_one_pull() {
    let data = bytes(MIB, 6);
    let hub = MockHub::start(vec![gguf_repo(q4(data.clone()).cut(1))]);
    let home = tempfile::tempdir().unwrap();
    let out = pull(
        &hub.endpoint,
        home.path(),
        &[&format!("{GGUF_REPO}:Q4_K_M")],
    )
    .success();
    assert_eq!(std::fs::read(stdout(&out)).unwrap(), data);
}

#[test]
fn rejects_a_file_whose_sha256_differs_from_the_hub_id() {
    let wrong = "ab".repeat(32);
    let hub = MockHub::start(vec![gguf_repo(q4(bytes(5000, 7)).with_id(wrong.clone()))]);
    let home = tempfile::tempdir().unwrap();
    let out = pull(
        &hub.endpoint,
        home.path(),
        &[&format!("{GGUF_REPO}:Q4_K_M")],
    )
    .failure();
    let err = stderr(&out);
    assert!(err.contains("is corrupt") && err.contains(&wrong), "{err}");
    let dir = repo_dir(home.path(), GGUF_REPO);
    assert!(!dir.join("blobs").join(&wrong).exists());
    assert!(
        !dir.join("snapshots")
            .join(COMMIT)
            .join("tiny-q4_k_m.gguf")
            .exists()
    );
}

#[test]
fn names_the_quants_that_exist() {
    let hub = MockHub::start(vec![gguf_repo(q4(bytes(100, 8)))]);
    let home = tempfile::tempdir().unwrap();
    let out = pull(
        &hub.endpoint,
        home.path(),
        &[&format!("{GGUF_REPO}:Q5_K_M")],
    )
    .failure();
    let err = stderr(&out);
    assert!(err.contains("has no Q5_K_M"), "{err}");
    assert!(err.contains("Q4_K_M, Q8_0"), "{err}");
    let out = pull(&hub.endpoint, home.path(), &[GGUF_REPO]).failure();
    assert!(stderr(&out).contains("several quantizations"));
}

#[test]
fn says_when_the_repo_or_the_network_is_missing() {
    let hub = MockHub::start(vec![gguf_repo(q4(bytes(100, 9)))]);
    let home = tempfile::tempdir().unwrap();
    let out = pull(&hub.endpoint, home.path(), &["test/nope:Q4_K_M"]).failure();
    let err = stderr(&out);
    assert!(err.contains("repository test/nope not found"), "{err}");
    assert_eq!(err.lines().count(), 2, "{err}");

    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let out = pull(&endpoint, home.path(), &[&format!("{GGUF_REPO}:Q4_K_M")]).failure();
    assert!(stderr(&out).contains("cannot reach"), "{}", stderr(&out));
}

#[test]
fn a_full_disk_leaves_nothing_under_the_final_name() {
    let data = bytes(200_000, 10);
    let id = mock_hub::hex(&<sha2::Sha256 as sha2::Digest>::digest(&data));
    let hub = MockHub::start(vec![gguf_repo(q4(data))]);
    let home = tempfile::tempdir().unwrap();
    let blobs = repo_dir(home.path(), GGUF_REPO).join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    // Writes to /dev/full fail with ENOSPC, as on a full disk.
    std::os::unix::fs::symlink("/dev/full", blobs.join(format!("{id}.part"))).unwrap();
    let out = pull(
        &hub.endpoint,
        home.path(),
        &[&format!("{GGUF_REPO}:Q4_K_M")],
    )
    .failure();
    assert!(stderr(&out).contains("disk is full"), "{}", stderr(&out));
    assert!(!blobs.join(&id).exists());
}

#[test]
#[cfg_attr(debug_assertions, ignore = "runs a real model: release only")]
fn pull_list_run_rm_a_real_model() {
    let Some(model) = common::smollm2() else {
        return;
    };
    let repo = "test/SmolLM2-135M-Instruct-GGUF";
    let data = std::fs::read(&model).unwrap();
    let hub = MockHub::start(vec![(
        repo.to_string(),
        vec![
            MockFile::git("README.md", b"# smol\n".to_vec()),
            MockFile::lfs("SmolLM2-135M-Instruct.Q4_1.gguf", data),
        ],
    )]);
    let home = tempfile::tempdir().unwrap();
    // One GGUF in the repo: no quant needed.
    let pulled = pull(&hub.endpoint, home.path(), &[repo]).success();
    let path = stdout(&pulled);
    let env = |cmd: &mut assert_cmd::Command| {
        cmd.env("HF_HOME", home.path()).env_remove("HF_HUB_CACHE");
    };

    let mut list = flatrun();
    env(&mut list);
    let listed = list.arg("list").assert().success();
    let table = stdout(&listed);
    let name = format!("{repo}:Q4_1");
    assert!(table.contains(&name), "{table}");
    assert!(
        table.contains("llama") && table.contains("Q4_1×"),
        "{table}"
    );
    assert!(table.contains(&path), "{table}");
    let mut json = flatrun();
    env(&mut json);
    let json = json.args(["list", "--json"]).assert().success();
    let rows: serde_json::Value = serde_json::from_str(&stdout(&json)).unwrap();
    assert_eq!(rows[0]["name"], name.as_str());
    assert_eq!(rows[0]["format"], "gguf");

    let mut run = flatrun();
    env(&mut run);
    run.args([
        "run", "--model", &name, "--prompt", "Hello", "-n", "2", "--quiet",
    ])
    .assert()
    .success();

    let mut rm = flatrun();
    env(&mut rm);
    let removed = rm.args(["rm", &name]).assert().success();
    assert!(stderr(&removed).contains("freed"), "{}", stderr(&removed));
    assert!(!Path::new(&path).exists());
    assert!(!repo_dir(home.path(), repo).exists());
    let mut gone = flatrun();
    env(&mut gone);
    let out = gone.args(["rm", &name]).assert().failure();
    assert!(stderr(&out).contains("not in the cache"));
}

#[test]
fn the_progress_bar_redraws_in_a_terminal_and_clears() {
    if !tmux::tmux_available() {
        return;
    }
    let hub = MockHub::start(vec![gguf_repo(q4(bytes(4 * MIB, 11)).slow())]);
    let home = tempfile::tempdir().unwrap();
    let command = format!(
        "env -u HF_HUB_CACHE -u HF_TOKEN HF_ENDPOINT={} HF_HOME={} {} pull {GGUF_REPO}:Q4_K_M",
        hub.endpoint,
        home.path().display(),
        common::flatrun_path().display()
    );
    let term = tmux::Tmux::start("pull", &command);
    // Mid-transfer: the bar with bytes, rate and time left.
    let during = term.wait_for("the progress bar", 30, |s| {
        s.lines().any(|l| {
            l.starts_with("tiny-q4_k_m.gguf [=") && l.contains("/s eta") && !l.contains(" 0 B/s")
        })
    });
    assert!(during.contains("/4.00 MiB"), "{during}");
    term.wait_dead("pull");
    let after = term.screen();
    // The bar is gone; the final lines stay.
    assert!(!after.contains("eta"), "{after}");
    assert!(
        after.contains("tiny-q4_k_m.gguf: 4.0 MiB of 4.0 MiB"),
        "{after}"
    );
    assert!(after.contains("pulled test/tiny-GGUF:Q4_K_M"), "{after}");
    assert!(after.contains("snapshots"), "{after}");
}
