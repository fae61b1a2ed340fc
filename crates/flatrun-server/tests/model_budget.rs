//! Models the server loads itself: on their first request (requests
//! arriving meanwhile share that one load), under a memory budget (each
//! load gets what is left; idle models are unloaded least recently used
//! first to make room, busy ones never), and unloaded after the keep-alive.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{TestServer, config, open_stream_until};
use flatrun_server::mock::{MockConfig, mock_engine};
use flatrun_server::{
    Engine, Footprint, LoadedModel, ModelLoader, ModelPolicy, SchedulerConfig, ServerConfig,
};
use serde_json::{Value, json};

/// A mock model that says how much memory it needs: `resident` whole,
/// `least` streamed; it loads resident when the budget allows.
struct MockLoader {
    name: String,
    resident: u64,
    least: u64,
    fail: bool,
    delay: Duration,
    loads: AtomicU64,
    budgets: Mutex<Vec<Option<u64>>>,
}

impl MockLoader {
    fn new(name: &str, resident: u64, least: u64) -> MockLoader {
        MockLoader {
            name: name.into(),
            resident,
            least,
            fail: false,
            delay: Duration::from_millis(50),
            loads: AtomicU64::new(0),
            budgets: Mutex::new(Vec::new()),
        }
    }
}

impl ModelLoader for MockLoader {
    fn footprint(&self) -> Result<Footprint, String> {
        Ok(Footprint {
            resident: self.resident,
            least: self.least,
        })
    }

    fn load(&self, budget: Option<u64>) -> Result<LoadedModel, String> {
        std::thread::sleep(self.delay);
        self.budgets.lock().unwrap().push(budget);
        if self.fail {
            return Err(format!("{}: not a GGUF file", self.name));
        }
        self.loads.fetch_add(1, Ordering::SeqCst);
        let resident = budget.is_none_or(|b| b >= self.resident);
        let mock = MockConfig {
            model_name: self.name.clone(),
            reply: format!("Answer of {}.", self.name),
            repeat: true,
            step_delay: Duration::from_millis(5),
            ..MockConfig::default()
        };
        let (engine, _) =
            mock_engine(mock, SchedulerConfig::default()).map_err(|e| e.to_string())?;
        let engine: Arc<dyn Engine> = Arc::new(engine);
        Ok(LoadedModel {
            engine,
            memory_bytes: if resident { self.resident } else { self.least },
            residency: if resident { "resident" } else { "stream" }.into(),
        })
    }
}

async fn server_with(policy: ModelPolicy, loaders: &[Arc<MockLoader>]) -> TestServer {
    let config = ServerConfig {
        model_policy: policy,
        ..config()
    };
    let server = TestServer::default_with(config).await;
    for loader in loaders {
        assert!(server.models.add_loader(&loader.name, loader.clone()));
    }
    server
}

fn chat(model: &str, max_tokens: u32) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "temperature": 0})
}

/// Opens a long streamed answer of `model` and returns its connection
/// (the model is busy until it is dropped).
async fn keep_busy(server: &TestServer, model: &str) -> tokio::net::TcpStream {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 480, "stream": true});
    let (socket, _) = open_stream_until(
        server.addr,
        "/v1/chat/completions",
        &[],
        &body.to_string(),
        "data: ",
    )
    .await;
    socket
}

/// `status` of each model in `/v1/models`, by name.
async fn statuses(server: &TestServer) -> Vec<(String, Value)> {
    let r = server.get("/v1/models").await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap().to_string(), m["status"].clone()))
        .collect()
}

async fn status_of(server: &TestServer, name: &str) -> Value {
    statuses(server)
        .await
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("{name} not listed"))
}

#[tokio::test]
async fn a_model_loads_on_its_first_request_once() {
    let a = Arc::new(MockLoader {
        delay: Duration::from_millis(300),
        ..MockLoader::new("a", 60, 10)
    });
    let server = server_with(ModelPolicy::default(), std::slice::from_ref(&a)).await;
    // Listed before it is loaded, and not loaded by being listed.
    assert_eq!(status_of(&server, "a").await["value"], "unloaded");
    assert_eq!(a.loads.load(Ordering::SeqCst), 0);
    // Three requests at once: one load, all answered.
    let body = chat("a", 3);
    let completion = json!({"model": "a", "prompt": "x", "max_tokens": 3});
    let (r1, r2, r3) = tokio::join!(
        server.post_json("/v1/chat/completions", &body),
        server.post_json("/v1/chat/completions", &body),
        server.post_json("/v1/completions", &completion),
    );
    for r in [&r1, &r2, &r3] {
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["model"], "a");
    }
    let content = r1.json()["choices"][0]["message"]["content"].clone();
    assert!(content.as_str() == Some("Ans"), "{content}");
    assert_eq!(a.loads.load(Ordering::SeqCst), 1);
    // No budget: the loader was given none.
    assert_eq!(a.budgets.lock().unwrap().as_slice(), &[None]);
    let status = status_of(&server, "a").await;
    assert_eq!(status["value"], "loaded");
    assert_eq!(status["residency"], "resident");
    let metrics = server.get("/metrics").await.body;
    assert!(
        metrics.contains("flatrun_served_model_loads_total{model=\"a\"} 1"),
        "{metrics}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_budget_unloads_idle_models_first_and_streams_beside_busy_ones() {
    let a = Arc::new(MockLoader::new("a", 60, 10));
    let b = Arc::new(MockLoader::new("b", 60, 10));
    let c = Arc::new(MockLoader::new("c", 60, 10));
    let policy = ModelPolicy {
        max_resident: Some(100),
        keep_alive: None,
    };
    let server = server_with(policy, &[a.clone(), b.clone(), c.clone()]).await;
    // a fits whole: it gets all but what b and c would need streamed.
    let r = server
        .post_json("/v1/chat/completions", &chat("a", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(a.budgets.lock().unwrap().as_slice(), &[Some(80)]);
    assert_eq!(status_of(&server, "a").await["residency"], "resident");
    // b does not fit beside a, which is idle: a is unloaded, b is resident.
    let r = server
        .post_json("/v1/chat/completions", &chat("b", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(b.budgets.lock().unwrap().as_slice(), &[Some(90)]);
    assert_eq!(status_of(&server, "a").await["value"], "unloaded");
    assert_eq!(status_of(&server, "b").await["residency"], "resident");
    // While b generates, c gets what is left (40) but the 10 kept for a
    // to stream: it streams.
    let busy = keep_busy(&server, "b").await;
    let r = server
        .post_json("/v1/chat/completions", &chat("c", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(c.budgets.lock().unwrap().as_slice(), &[Some(30)]);
    assert_eq!(status_of(&server, "b").await["value"], "loaded");
    let status = status_of(&server, "c").await;
    assert_eq!(status["residency"], "stream");
    assert_eq!(status["memory_bytes"], 10);
    // a again, b still busy: even unloading the idle c would leave too
    // little for a whole (40 < 60), so c stays and a streams in the 30
    // left.
    let r = server
        .post_json("/v1/chat/completions", &chat("a", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(a.budgets.lock().unwrap().last(), Some(&Some(30)));
    assert_eq!(status_of(&server, "c").await["value"], "loaded");
    assert_eq!(status_of(&server, "a").await["residency"], "stream");
    drop(busy);
    let metrics = server.get("/metrics").await.body;
    for line in [
        "flatrun_served_model_unloads_total{model=\"a\"} 1",
        "flatrun_served_model_loads_total{model=\"a\"} 2",
        "flatrun_served_model_memory_bytes{model=\"b\"} 60",
        "flatrun_served_models_memory_budget_bytes 100",
    ] {
        assert!(metrics.contains(line), "{line} not in\n{metrics}");
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn no_room_beside_busy_models_is_a_503() {
    let a = Arc::new(MockLoader::new("a", 40, 30));
    let b = Arc::new(MockLoader::new("b", 40, 30));
    let policy = ModelPolicy {
        max_resident: Some(50),
        keep_alive: None,
    };
    let server = server_with(policy, &[a.clone(), b.clone()]).await;
    let busy = keep_busy(&server, "a").await;
    let r = server
        .post_json("/v1/chat/completions", &chat("b", 2))
        .await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "insufficient_memory");
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("`b` needs 30 bytes"), "{message}");
    assert_eq!(b.loads.load(Ordering::SeqCst), 0);
    // Once a is done, b loads (a is unloaded to make room).
    drop(busy);
    let mut answered = None;
    for _ in 0..100 {
        let r = server
            .post_json("/v1/chat/completions", &chat("b", 2))
            .await;
        if r.status == 200 {
            answered = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(answered.is_some(), "b never loaded");
    assert_eq!(status_of(&server, "a").await["value"], "unloaded");
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_idle_model_unloads_after_the_keep_alive_and_loads_again() {
    let a = Arc::new(MockLoader::new("a", 60, 10));
    let policy = ModelPolicy {
        max_resident: None,
        keep_alive: Some(Duration::from_millis(200)),
    };
    let server = server_with(policy, std::slice::from_ref(&a)).await;
    let r = server
        .post_json("/v1/chat/completions", &chat("a", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(status_of(&server, "a").await["value"], "loaded");
    let mut unloaded = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if status_of(&server, "a").await["value"] == "unloaded" {
            unloaded = true;
            break;
        }
    }
    assert!(unloaded, "a stayed loaded past its keep-alive");
    // The default model (installed by the caller) stays.
    let r = server
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = server
        .post_json("/v1/chat/completions", &chat("a", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(a.loads.load(Ordering::SeqCst), 2);
    // /health stays ready throughout.
    assert_eq!(server.get("/health").await.status, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_model_that_fails_to_load_is_a_500_and_the_others_go_on() {
    let broken = Arc::new(MockLoader {
        fail: true,
        ..MockLoader::new("broken", 10, 5)
    });
    let a = Arc::new(MockLoader::new("a", 10, 5));
    let server = server_with(ModelPolicy::default(), &[broken.clone(), a.clone()]).await;
    for _ in 0..2 {
        let r = server
            .post_json("/v1/chat/completions", &chat("broken", 2))
            .await;
        assert_eq!(r.status, 500, "{}", r.body);
        assert_eq!(r.json()["error"]["code"], "model_load_failed");
        assert!(r.body.contains("not a GGUF file"), "{}", r.body);
    }
    let r = server
        .post_json(
            "/v1/messages",
            &json!({"model": "broken", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status, 500, "{}", r.body);
    assert_eq!(r.json()["type"], "error");
    let r = server
        .post_json("/v1/chat/completions", &chat("a", 2))
        .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(status_of(&server, "broken").await["value"], "unloaded");
    server.shutdown().await.unwrap();
}
