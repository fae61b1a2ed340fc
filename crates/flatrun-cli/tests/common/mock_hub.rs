//! A Hugging Face Hub on 127.0.0.1 for the `pull` tests: the endpoints and
//! headers `hf-hub` uses (`/api/models/{repo}/revision/{rev}`, and
//! `/{repo}/resolve/{rev}/{file}` answering range requests with `etag` /
//! `x-linked-etag`, `x-repo-commit` and `content-range`), over fixture repos.
#![allow(dead_code)]

use sha2::Digest;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The commit every fixture repo is at.
pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A file of a fixture repo.
pub struct MockFile {
    pub name: String,
    pub data: Vec<u8>,
    /// The hub id: sha256 for LFS files, git blob sha1 otherwise.
    pub id: String,
    pub lfs: bool,
    /// Body transfers still to cut off halfway.
    pub cuts: AtomicUsize,
    /// Send the body in 64 KiB pieces 30 ms apart (to watch a progress bar).
    pub slow: bool,
}

impl MockFile {
    /// An LFS file (a weights file): id = sha256 of `data`.
    pub fn lfs(name: &str, data: Vec<u8>) -> MockFile {
        let id = hex(&sha2::Sha256::digest(&data));
        MockFile {
            name: name.into(),
            data,
            id,
            lfs: true,
            cuts: AtomicUsize::new(0),
            slow: false,
        }
    }

    /// A small git file: id = git blob sha1.
    pub fn git(name: &str, data: Vec<u8>) -> MockFile {
        let mut hasher = sha1::Sha1::new();
        hasher.update(format!("blob {}\0", data.len()).as_bytes());
        hasher.update(&data);
        let id = hex(&hasher.finalize());
        MockFile {
            name: name.into(),
            data,
            id,
            lfs: false,
            cuts: AtomicUsize::new(0),
            slow: false,
        }
    }

    /// Cut the next `n` body transfers off halfway.
    pub fn cut(self, n: usize) -> MockFile {
        self.cuts.store(n, Ordering::SeqCst);
        self
    }

    /// Send the body slowly.
    pub fn slow(mut self) -> MockFile {
        self.slow = true;
        self
    }

    /// Advertise `id` instead of the data's own.
    pub fn with_id(mut self, id: String) -> MockFile {
        self.id = id;
        self
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic filler bytes.
pub fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A request the hub saw: method and path, the Range and Authorization headers.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
}

type Repos = Vec<(String, Vec<MockFile>)>;

/// The running mock hub; stops when dropped.
pub struct MockHub {
    pub endpoint: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    port: u16,
}

impl MockHub {
    pub fn start(repos: Repos) -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let repos = Arc::new(repos);
        {
            let (seen, stop) = (seen.clone(), stop.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let (repos, seen) = (repos.clone(), seen.clone());
                    std::thread::spawn(move || {
                        let _ = serve(stream, &repos, &seen);
                    });
                }
            });
        }
        MockHub {
            endpoint: format!("http://127.0.0.1:{port}"),
            seen,
            stop,
            port,
        }
    }

    /// Requests whose path contains `part`.
    pub fn requests(&self, part: &str) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|s| s.path.contains(part))
            .cloned()
            .collect()
    }
}

impl Drop for MockHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve(stream: TcpStream, repos: &Repos, seen: &Mutex<Vec<Seen>>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let (mut range, mut authorization) = (None, None);
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.trim().split_once(':') {
            match name.to_ascii_lowercase().as_str() {
                "range" => range = Some(value.trim().to_string()),
                "authorization" => authorization = Some(value.trim().to_string()),
                _ => {}
            }
        }
    }
    seen.lock().unwrap().push(Seen {
        path: path.clone(),
        range: range.clone(),
        authorization,
    });
    let mut out = stream;
    let reply = |out: &mut TcpStream, status: &str, headers: &str, body: &[u8]| {
        write!(
            out,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
            body.len()
        )?;
        out.write_all(body)
    };
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let repo = rest.split("/revision/").next().unwrap_or("");
        return match repos.iter().find(|(name, _)| name == repo) {
            Some((_, files)) => {
                let siblings: Vec<String> = files
                    .iter()
                    .map(|f| format!("{{\"rfilename\":\"{}\"}}", f.name))
                    .collect();
                let body = format!(
                    "{{\"id\":\"{repo}\",\"sha\":\"{COMMIT}\",\"siblings\":[{}]}}",
                    siblings.join(",")
                );
                reply(
                    &mut out,
                    "200 OK",
                    "Content-Type: application/json\r\n",
                    body.as_bytes(),
                )
            }
            None => reply(
                &mut out,
                "401 Unauthorized",
                "Content-Type: application/json\r\n",
                b"{\"error\":\"Repository not found\"}",
            ),
        };
    }
    let found = path.split_once("/resolve/").and_then(|(repo, rest)| {
        let file = rest.split_once('/')?.1;
        let (_, files) = repos.iter().find(|(name, _)| name == &repo[1..])?;
        files.iter().find(|f| f.name == file)
    });
    let Some(file) = found else {
        return reply(&mut out, "404 Not Found", "", b"Entry not found");
    };
    let size = file.data.len();
    let (start, end) = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(s, e)| {
            let start: usize = s.parse().unwrap_or(0);
            let end: usize = e.parse().unwrap_or(size - 1).min(size - 1);
            (start, end)
        })
        .unwrap_or((0, size - 1));
    let mut headers = format!(
        "x-repo-commit: {COMMIT}\r\nContent-Range: bytes {start}-{end}/{size}\r\nAccept-Ranges: bytes\r\n"
    );
    if file.lfs {
        headers.push_str(&format!(
            "x-linked-etag: \"{}\"\r\nx-linked-size: {size}\r\netag: \"{}\"\r\n",
            file.id, file.id
        ));
    } else {
        headers.push_str(&format!("etag: \"{}\"\r\n", file.id));
    }
    let body = &file.data[start..=end];
    let cut = body.len() > 1
        && file
            .cuts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
    if cut {
        write!(
            out,
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
            body.len()
        )?;
        out.write_all(&body[..body.len() / 2])?;
        out.flush()?;
        return out.shutdown(std::net::Shutdown::Both);
    }
    if file.slow && body.len() > 1 {
        write!(
            out,
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nConnection: close\r\n{headers}\r\n",
            body.len()
        )?;
        for piece in body.chunks(64 << 10) {
            out.write_all(piece)?;
            out.flush()?;
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
        return Ok(());
    }
    reply(&mut out, "206 Partial Content", &headers, body)
}
