//! `dspec serve` end to end: the binary on a tiny model, listening on 127.0.0.1 with a
//! port it picks, spoken to by a plain HTTP client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use dspec_engine::tiny_model::write_tiny_model;

mod common;

/// A running server; killed when dropped.
struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<Vec<String>>>,
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    /// `dspec serve` on a fresh tiny model; `drafter` as --drafter takes it, with
    /// `{dir}` standing for the model's directory.
    fn start(drafter: &str, extra: &[&str]) -> Server {
        Self::start_on("{}", drafter, extra)
    }

    /// [`Server::start`] on the tiny model with `overrides` of its config.
    fn start_on(overrides: &str, drafter: &str, extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().expect("temp dir");
        write_tiny_model(dir.path(), overrides, 7).expect("tiny model");
        let model = dir.path().to_str().expect("utf-8 path").to_string();
        Self::start_model(&model, Some(dir), drafter, extra)
    }

    /// The real SmolLM2-135M served with n-gram drafts and `extra` flags.
    fn start_smollm2(extra: &[&str]) -> Server {
        let (_, model) = common::fetch_real_model("smollm2");
        Self::start_model(model.to_str().expect("utf-8 path"), None, "ngram", extra)
    }

    /// `dspec serve` on the model directory `model`, served as "tiny".
    fn start_model(
        model: &str,
        dir: Option<tempfile::TempDir>,
        drafter: &str,
        extra: &[&str],
    ) -> Server {
        Self::start_with_env(model, dir, drafter, extra, &[])
    }

    /// [`Server::start_model`] with `env` set for the server's process alone.
    fn start_with_env(
        model: &str,
        dir: Option<tempfile::TempDir>,
        drafter: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Server {
        let model = model.to_string();
        let drafter = drafter.replace("{dir}", &model);
        let mut child = Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args(["serve", "--target", &model, "--drafter", &drafter])
            .args(["--port", "0", "--served-model-name", "tiny"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start dspec serve");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = channel();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("http://") {
                    let addr = line[at + 7..].split_whitespace().next().unwrap_or("");
                    let _ = addr_tx.send(addr.to_string());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no address from dspec serve: {:?}", log.lock().unwrap()));
        Server {
            child,
            addr,
            log,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        answer(ureq::post(&self.url(path)).send_json(body.clone()))
    }

    fn get(&self, path: &str) -> (u16, Value) {
        answer(ureq::get(&self.url(path)).call())
    }

    /// Waits until a stderr line contains `text`.
    fn wait_for_log(&self, text: &str) -> String {
        self.wait_for_logs(text, 1)
    }

    /// Waits until `count` stderr lines contain `text`; returns the last of them.
    fn wait_for_logs(&self, text: &str, count: usize) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let found: Vec<String> = self
                .log
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains(text))
                .cloned()
                .collect();
            if found.len() >= count {
                return found[count - 1].clone();
            }
            assert!(
                Instant::now() < deadline,
                "no log line with {text:?}: {:?}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn answer(result: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let response = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("request failed: {e}"),
    };
    let status = response.status();
    let body = response.into_json().expect("a JSON body");
    (status, body)
}

/// The `data:` payloads of a streamed response, `[DONE]` included.
fn stream(server: &Server, path: &str, body: &Value) -> Vec<String> {
    let response = ureq::post(&server.url(path))
        .send_json(body.clone())
        .expect("streamed request");
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.header("content-type"),
        Some("text/event-stream"),
        "SSE content type"
    );
    BufReader::new(response.into_reader())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn chat_body(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
                          "max_tokens": 12, "temperature": 0});
    for (k, v) in extra.as_object().expect("object").iter() {
        body[k] = v.clone();
    }
    body
}

fn dspec_stats(body: &Value) -> &Value {
    let stats = &body["dspec"];
    for key in [
        "tau",
        "drafted",
        "accepted",
        "acceptance_histogram",
        "decode_tokens_per_second",
    ] {
        assert!(!stats[key].is_null(), "dspec.{key} missing: {body}");
    }
    stats
}

#[test]
fn chat_completions_stream_the_same_text_they_answer_whole() {
    let server = Server::start("ngram", &[]);
    assert_eq!(server.get("/health").0, 200);
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "tiny");

    let (status, whole) = server.post("/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let text = whole["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    let usage = &whole["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{whole}");
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&completion_tokens), "{whole}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() + completion_tokens)
    );
    dspec_stats(&whole);

    let events = stream(
        &server,
        "/v1/chat/completions",
        &chat_body(json!({"stream": true})),
    );
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut streamed = String::new();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"], "one id per stream");
        if let Some(piece) = chunk["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(piece);
        }
    }
    assert_eq!(
        streamed, text,
        "greedy: streamed deltas equal the whole answer"
    );
    let last = chunks.last().expect("chunks");
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    for count in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][count], whole["usage"][count], "{count}");
    }
    // The same prompt again: all of it but its last token came from the prompt cache.
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(prompt_tokens - 1),
        "{last}"
    );
    dspec_stats(last);
    server.wait_for_log("POST /v1/chat/completions 200");
}

#[test]
fn completions_end_before_a_stop_string_and_a_twin_drafter_keeps_every_draft() {
    // The draft model is the target itself: every greedy draft is the target's own
    // choice, so each round keeps them all. One request at a time: a sampled request's
    // text repeats only alone (in a batch its draws follow the drafts the load lets
    // through).
    let server = Server::start("model:{dir}", &["--max-draft", "4", "--max-batch", "1"]);
    let body =
        json!({"model": "tiny", "prompt": "once upon a time", "max_tokens": 24, "temperature": 0});
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    let stats = dspec_stats(&whole);
    assert!(stats["tau"].as_f64().unwrap() > 1.5, "{whole}");
    assert_eq!(stats["drafted"], stats["accepted"], "{whole}");

    let text = whole["choices"][0]["text"].as_str().expect("text");
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "a text long enough to cut: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let expected = &text[..text.find(&stop).expect("stop occurs")];
    let (status, cut) = server.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "once upon a time", "max_tokens": 24, "temperature": 0,
                "stop": [stop, "never appears"]}),
    );
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["choices"][0]["text"], expected, "{cut}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");

    // Sampled requests speculate too, and a seed makes them repeatable.
    let sampled = json!({"model": "tiny", "prompt": "once upon a time", "max_tokens": 16,
                         "temperature": 0.8, "top_p": 0.9, "seed": 11});
    let (status, a) = server.post("/v1/completions", &sampled);
    assert_eq!(status, 200, "{a}");
    let (_, b) = server.post("/v1/completions", &sampled);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert!(dspec_stats(&a)["drafted"].as_u64().unwrap() > 0, "{a}");
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start("ngram", &["--max-body-bytes", "2048"]);
    let error = |status: u16, body: &Value, want: u16, param: Option<&str>| {
        assert_eq!(status, want, "{body}");
        let e = &body["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert!(e["type"].is_string(), "{body}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{body}");
        }
    };
    let raw = ureq::post(&server.url("/v1/chat/completions"))
        .set("content-type", "application/json")
        .send_string("{\"messages\": [");
    let (status, body) = answer(raw);
    error(status, &body, 400, Some("body"));

    for (extra, param) in [
        (json!({"temperature": -1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": 100000}), "max_tokens"),
        (json!({"n": 2}), "n"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        // The tiny model's template never reads `tools`.
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": "required"}),
            "tool_choice",
        ),
        (json!({"messages": "hi"}), "messages"),
    ] {
        let (status, body) = server.post("/v1/chat/completions", &chat_body(extra));
        error(status, &body, 400, Some(param));
    }
    let (status, body) = server.post(
        "/v1/chat/completions",
        &chat_body(json!({"model": "gpt-4o"})),
    );
    error(status, &body, 404, Some("model"));
    let (_, body) = server.post(
        "/v1/chat/completions",
        &chat_body(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})),
    );
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("the model's chat template does not support tools"),
        "{body}"
    );

    // 300 byte tokens: over the tiny model's 256-token context.
    let long = "ab".repeat(150);
    let (status, body) = server.post("/v1/completions", &json!({"prompt": long, "max_tokens": 4}));
    error(status, &body, 400, Some("prompt"));
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    // 200 prompt tokens fit, but not with 100 more.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "ab".repeat(100), "max_completion_tokens": 100}),
    );
    error(status, &body, 400, Some("max_completion_tokens"));
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "hi", "max_tokens": 4, "padding": "x".repeat(4000)}),
    );
    error(status, &body, 413, None);
    let (status, body) = server.get("/v1/nothing");
    error(status, &body, 404, None);

    let (status, body) = server.post("/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(status, 200, "still serving after bad requests: {body}");
    server.wait_for_log("POST /v1/chat/completions 400");
}

/// Wider and with a longer context than the usual tiny model, so that a long
/// generation keeps the model busy for seconds.
const BIGGER: &str = r#"{"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                          "max_position_embeddings": 2048}"#;

/// A greedy request that runs to 1000 tokens on [`BIGGER`].
fn long_request() -> Value {
    json!({"model": "tiny", "prompt": "tell me everything", "max_tokens": 1000, "temperature": 0})
}

/// One request at a time (`--max-batch 1`): a queue of one behind a busy model.
#[test]
fn a_full_queue_answers_429_and_no_answer_is_lost_or_mixed() {
    let server = Arc::new(Server::start_on(
        BIGGER,
        "ngram",
        &["--queue-size", "1", "--max-batch", "1"],
    ));
    let body = |i: usize| json!({"model": "tiny", "prompt": format!("client {i} says"), "max_tokens": 8, "temperature": 0});
    // Each client's own answer, asked alone.
    let alone: Vec<Value> = (0..4)
        .map(|i| server.post("/v1/completions", &body(i)).1["choices"][0]["text"].clone())
        .collect();
    // The model busy with a long stream: one client may wait, the others are refused.
    let mut long = long_request();
    long["stream"] = json!(true);
    let busy = open_stream(&server, &long);
    let (answers_tx, answers) = channel();
    for i in 0..4 {
        let server = server.clone();
        let body = body(i);
        let answers_tx = answers_tx.clone();
        std::thread::spawn(move || {
            let _ = answers_tx.send((i, server.post("/v1/completions", &body)));
        });
    }
    let mut refused = 0;
    let mut served = 0;
    for n in 0..4 {
        if n == 3 {
            // Three refused while the long stream runs: free the model for the fourth.
            let _ = busy.shutdown(std::net::Shutdown::Both);
        }
        let (i, (status, answer)) = answers
            .recv_timeout(Duration::from_secs(60))
            .expect("every client gets an answer");
        match status {
            200 => {
                assert_eq!(
                    answer["choices"][0]["text"], alone[i],
                    "client {i} got its own text"
                );
                served += 1;
            }
            429 => {
                assert_eq!(answer["error"]["type"], "rate_limit_error", "{answer}");
                refused += 1;
            }
            other => panic!("client {i}: status {other}: {answer}"),
        }
    }
    assert_eq!(
        (served, refused),
        (1, 3),
        "queue of one behind a busy model"
    );
    drop(busy);
}

/// A bounded load: 16 clients × 4 requests at once against a queue of 4. Every request
/// is answered, 200 with the text its prompt gets when asked alone or 429 as an OpenAI
/// error, and the server still answers afterwards.
#[test]
fn sixteen_clients_at_once_get_their_own_answers_or_429() {
    let server = Arc::new(Server::start("ngram", &["--queue-size", "4"]));
    let body = |i: usize| json!({"model": "tiny", "prompt": format!("client {i} asks"), "max_tokens": 6, "temperature": 0});
    let alone: Vec<Value> = (0..16)
        .map(|i| server.post("/v1/completions", &body(i)).1["choices"][0]["text"].clone())
        .collect();
    let (answers_tx, answers) = channel();
    for i in 0..16 {
        let server = server.clone();
        let answers_tx = answers_tx.clone();
        std::thread::spawn(move || {
            for _ in 0..4 {
                let _ = answers_tx.send((i, server.post("/v1/completions", &body(i))));
            }
        });
    }
    drop(answers_tx);
    let (mut served, mut refused) = (0, 0);
    for _ in 0..64 {
        let (i, (status, answer)) = answers
            .recv_timeout(Duration::from_secs(120))
            .expect("every request gets an answer");
        match status {
            200 => {
                assert_eq!(
                    answer["choices"][0]["text"], alone[i],
                    "client {i}'s own text"
                );
                served += 1;
            }
            429 => {
                assert_eq!(answer["error"]["type"], "rate_limit_error", "{answer}");
                refused += 1;
            }
            other => panic!("client {i}: status {other}: {answer}"),
        }
    }
    assert_eq!(served + refused, 64);
    assert!(served >= 1, "some requests are served");
    let (status, _) = server.get("/health");
    assert_eq!(status, 200, "still serving after the load");
    let (status, answer) = server.post("/v1/completions", &body(3));
    assert_eq!((status, &answer["choices"][0]["text"]), (200, &alone[3]));
}

/// Sends a completion request on a raw socket, reading nothing back.
fn send_completion(server: &Server, body: &Value) -> TcpStream {
    let mut socket = TcpStream::connect(&server.addr).expect("connect");
    let payload = body.to_string();
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        server.addr,
        payload.len()
    )
    .expect("send");
    socket
}

/// Sends a streamed request on a raw socket and reads until the first text chunk.
fn open_stream(server: &Server, body: &Value) -> TcpStream {
    let mut socket = send_completion(server, body);
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    while !String::from_utf8_lossy(&seen).contains("\"text\"") {
        let n = socket.read(&mut buf).expect("read the stream");
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    socket
}

#[test]
fn a_client_that_disconnects_cancels_its_generation() {
    let server = Server::start_on(BIGGER, "ngram", &[]);
    let mut body = long_request();
    // Unhindered, the request runs to its limit (so a shorter count below is a cancel).
    let (status, whole) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(
        whole["usage"]["completion_tokens"], 1000,
        "{}",
        whole["usage"]
    );
    body["stream"] = json!(true);
    let socket = open_stream(&server, &body);
    // The model is busy; the HTTP side is not.
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
    drop(socket);
    let cancelled_after = |nth: usize| -> usize {
        let line = server.wait_for_logs("generation cancelled after", nth);
        line.split("after ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a token count in {line:?}"))
    };
    assert!(cancelled_after(1) < 1000);
    server.wait_for_log("client went away");

    // A client waiting for a whole answer that leaves cancels it too.
    body["stream"] = json!(false);
    let socket = send_completion(&server, &body);
    // Well inside the seconds the whole answer takes.
    std::thread::sleep(Duration::from_millis(1000));
    drop(socket);
    assert!(cancelled_after(2) < 1000);
    let (status, body) = server.post("/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(status, 200, "serving the next request: {body}");
}

#[test]
fn a_port_in_use_or_a_missing_model_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", 7).expect("tiny model");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let run = |target: &str| {
        Command::new(env!("CARGO_BIN_EXE_dspec"))
            .args(["serve", "--target", target, "--drafter", "ngram"])
            .args(["--port", &port])
            .output()
            .expect("run dspec serve")
    };
    let out = run(dir.path().to_str().expect("utf-8 path"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("--port {port}")) && err.contains("cannot listen"),
        "{err}"
    );
    let missing = dir.path().join("absent");
    let out = run(missing.to_str().expect("utf-8 path"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("absent") && !err.contains("panicked"), "{err}");
}

/// What the official `openai` Python client gets from the server: the model list, a
/// chat answer, the same answer streamed, a completion cut at a stop string, and the
/// drafter's stats on a repetitive prompt. Printed as one JSON object.
const OPENAI_CLIENT_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
out = {"models": [m.id for m in client.models.list().data]}
messages = [{"role": "user", "content": "What is the capital of France?"}]
answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
out["chat"] = answer.choices[0].message.content
stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True)
out["streamed"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
counted = client.completions.create(model="tiny", prompt="1, 2, 3, 4,", max_tokens=40, temperature=0, stop=[" 9"])
out["stopped"] = counted.choices[0].text
fox = "the quick brown fox jumps over the lazy dog. " * 3 + "the quick brown fox"
repeated = client.completions.create(model="tiny", prompt=fox, max_tokens=32, temperature=0)
out["tau"] = repeated.model_extra["dspec"]["tau"]
print(json.dumps(out))
"#;

/// Runs `script` with the official `openai` Python client (installed by
/// `scripts/setup.sh --test-clients`), the server's URL and `args` as its arguments;
/// returns the JSON it prints.
fn openai_client(server: &Server, script: &str, args: &[&str]) -> Value {
    let client = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/openai-client");
    assert!(
        client.join("openai").is_dir(),
        "the openai Python client is missing from {}: run scripts/setup.sh --test-clients",
        client.display()
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(format!("http://{}", server.addr))
        .args(args)
        .env("PYTHONPATH", &client)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "the client failed: {}\nserver log: {:?}",
        String::from_utf8_lossy(&out.stderr),
        server.log.lock().unwrap()
    );
    serde_json::from_slice(&out.stdout).expect("the script's JSON")
}

/// The official `openai` Python client against `dspec serve` on the real SmolLM2-135M
/// with n-gram speculation.
#[test]
fn the_openai_client_talks_to_dspec_serve_on_a_real_model() {
    let server = Server::start_smollm2(&["--max-draft", "4"]);
    let got = openai_client(&server, OPENAI_CLIENT_SCRIPT, &[]);
    assert_eq!(got["models"], json!(["tiny"]));
    let chat = got["chat"].as_str().expect("chat text");
    assert!(!chat.trim().is_empty(), "{got}");
    assert_eq!(
        got["streamed"].as_str(),
        Some(chat),
        "streamed deltas = whole answer"
    );
    let stopped = got["stopped"].as_str().expect("completion text");
    assert!(
        !stopped.contains(" 9"),
        "cut before the stop string: {stopped:?}"
    );
    assert!(
        stopped.contains('5'),
        "the count goes on before the stop: {stopped:?}"
    );
    let tau = got["tau"].as_f64().expect("tau");
    assert!(
        tau > 1.0,
        "n-gram drafts kept on a repetitive prompt: tau {tau}"
    );
}

/// A chat's second turn on the real SmolLM2: the prompt cache holds the first turn's
/// prompt and answer, so the second reads only its new message, and answers what a
/// server without a prompt cache answers.
#[test]
fn a_chats_second_turn_reads_only_its_new_message() {
    let (_, model) = common::fetch_real_model("smollm2");
    let model = model.to_str().expect("utf-8 path");
    let cached = Server::start_model(model, None, "ngram", &[]);
    let uncached = Server::start_model(model, None, "ngram", &["--prompt-cache-bytes", "0"]);
    let system = "You are a helpful assistant who answers in one short paragraph. \
                  Be precise, friendly and brief, and never repeat the question.";
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "What is the capital of France?"}),
    ];
    let turn = |server: &Server, messages: &[Value]| {
        let body = json!({"model": "tiny", "messages": messages, "max_tokens": 24,
                          "temperature": 0});
        let (status, answer) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{answer}");
        answer
    };
    let first = turn(&cached, &messages);
    let stats = &first["dspec"]["prompt_cache"];
    assert_eq!(stats["hit"], false, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let first_read = stats["prefilled_tokens"].as_u64().expect("prefilled");
    assert_eq!(Some(first_read), first["usage"]["prompt_tokens"].as_u64());
    assert!(
        stats["entries"].as_u64() == Some(1) && stats["bytes"].as_u64() > Some(0),
        "{first}"
    );

    let reply = first["choices"][0]["message"]["content"].clone();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And of Italy?"}));
    let second = turn(&cached, &messages);
    let stats = &second["dspec"]["prompt_cache"];
    assert_eq!(stats["hit"], true, "{second}");
    let prompt_tokens = second["usage"]["prompt_tokens"].as_u64().expect("prompt");
    let reused = stats["cached_tokens"].as_u64().expect("cached");
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(reused)
    );
    assert!(
        reused >= first_read,
        "the first turn's prompt at least came from the cache: {second}"
    );
    let second_read = stats["prefilled_tokens"].as_u64().expect("prefilled");
    assert_eq!(second_read, prompt_tokens - reused);
    assert!(
        second_read < first_read,
        "the second turn read {second_read} tokens, the first {first_read}"
    );

    let without = turn(&uncached, &messages);
    assert_eq!(without["dspec"]["prompt_cache"]["hit"], false);
    assert_eq!(
        second["choices"][0]["message"]["content"], without["choices"][0]["message"]["content"],
        "the cache changes what is read, never what is answered"
    );
}

/// Two log-probability entries for the same token: the same token, bytes and
/// alternatives in the same order, with log-probabilities equal to rounding (which drafts
/// a batched step verifies follows the load, and a position computed in a verify rounds
/// a little differently from one computed alone).
fn same_entry(a: &Value, b: &Value) {
    let close = |x: &Value, y: &Value| {
        let (x, y) = (x.as_f64().expect("logprob"), y.as_f64().expect("logprob"));
        assert!((x - y).abs() < 1e-4, "{a} against {b}");
    };
    assert_eq!(a["token"], b["token"], "{a} against {b}");
    assert_eq!(a["bytes"], b["bytes"], "{a} against {b}");
    close(&a["logprob"], &b["logprob"]);
    let (top_a, top_b) = (
        a["top_logprobs"].as_array().expect("top_logprobs"),
        b["top_logprobs"].as_array().expect("top_logprobs"),
    );
    assert_eq!(top_a.len(), top_b.len(), "{a} against {b}");
    for (x, y) in top_a.iter().zip(top_b) {
        assert_eq!(x["token"], y["token"], "{a} against {b}");
        close(&x["logprob"], &y["logprob"]);
    }
}

/// `logprobs` in both endpoints' shapes: one entry per generated token with its
/// alternatives, the likeliest first; a stream carries the same entries, each chunk
/// with its own text.
#[test]
fn log_probabilities_come_whole_and_streamed() {
    let server = Server::start("ngram", &[]);
    let body = chat_body(json!({"logprobs": true, "top_logprobs": 2}));
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content")
        .clone();
    let generated = whole["usage"]["completion_tokens"].as_u64().expect("count") as usize;
    let eos = usize::from(whole["dspec"]["stop_reason"] == "eos");
    assert_eq!(content.len(), generated - eos, "{whole}");
    for entry in &content {
        let logprob = entry["logprob"].as_f64().expect("logprob");
        assert!(logprob <= 0.0, "{entry}");
        let top = entry["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 2, "{entry}");
        // Greedy: the token is the likeliest, and alternatives come in order.
        assert!((top[0]["logprob"].as_f64().expect("top") - logprob).abs() < 1e-5);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).expect("bytes");
        assert_eq!(bytes, entry["token"].as_str().expect("token").as_bytes());
    }

    let events = stream(
        &server,
        "/v1/chat/completions",
        &chat_body(json!({"logprobs": true, "top_logprobs": 2, "stream": true})),
    );
    let mut streamed = Vec::new();
    let mut text = String::new();
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).expect("chunk");
        let choice = &chunk["choices"][0];
        text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(entries) = choice["logprobs"]["content"].as_array() {
            streamed.extend(entries.iter().cloned());
        }
    }
    assert_eq!(
        streamed.len(),
        content.len(),
        "the stream's entries are the answer's"
    );
    for (s, c) in streamed.iter().zip(&content) {
        same_entry(s, c);
    }
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"]
            .as_str()
            .expect("text")
    );

    let (status, completion) = server.post(
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "abc abc abc", "max_tokens": 6, "temperature": 0,
                "logprobs": 3}),
    );
    assert_eq!(status, 200, "{completion}");
    let logprobs = &completion["choices"][0]["logprobs"];
    let tokens = logprobs["tokens"].as_array().expect("tokens");
    assert!(!tokens.is_empty());
    for field in ["token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(
            logprobs[field].as_array().map(Vec::len),
            Some(tokens.len()),
            "{field}"
        );
    }
    assert_eq!(logprobs["text_offset"][0], 0);
    // Keyed by text: alternatives that read the same (pieces of one character) merge.
    let top = logprobs["top_logprobs"][0].as_object().expect("a map");
    assert!((1..=3).contains(&top.len()), "{completion}");
    let best = top
        .values()
        .filter_map(Value::as_f64)
        .fold(f64::MIN, f64::max);
    let first = logprobs["token_logprobs"][0].as_f64().expect("logprob");
    assert!(
        (best - first).abs() < 1e-5,
        "greedy: the likeliest: {completion}"
    );
    let (status, refused) = server.post(
        "/v1/chat/completions",
        &chat_body(json!({"top_logprobs": 2})),
    );
    assert_eq!(status, 400, "{refused}");
}

/// A Hermes-style chat template written for the tool tests: the tools in a system turn,
/// assistant calls as `<tool_call>` blocks, tool results as `tool` turns.
const HERMES_STYLE_TEMPLATE: &str = r#"{%- if tools %}
<|im_start|>system
You are a helpful assistant with these tools:
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
To call one, answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
<|im_start|>{{ message.role }}
{% if message.tool_calls is defined %}
{% for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
{% else %}
{{ message.content }}
{% endif %}
<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"#;

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather",
           "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}})
}

/// A conversation in which the assistant called `get_weather` twice, as OpenAI clients
/// send it back (arguments as JSON text), and then a third question.
fn weather_conversation() -> Value {
    let asked = |city: &str, id: &str, result: &str, answer: &str| {
        vec![
            json!({"role": "user", "content": format!("What is the weather in {city}?")}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
                   "type": "function", "function": {"name": "get_weather",
                   "arguments": json!({"city": city}).to_string()}}]}),
            json!({"role": "tool", "tool_call_id": id, "content": result}),
            json!({"role": "assistant", "content": answer}),
        ]
    };
    let mut messages = asked(
        "Tokyo",
        "call_1",
        "22 C, sunny",
        "It is 22 C and sunny in Tokyo.",
    );
    messages.extend(asked(
        "Rome",
        "call_2",
        "18 C, rain",
        "It is 18 C and raining in Rome.",
    ));
    messages.push(json!({"role": "user", "content": "What is the weather in Paris?"}));
    json!(messages)
}

/// `(name, arguments)` of the calls in a non-streamed chat answer.
fn answered_calls(body: &Value) -> Vec<(String, Value)> {
    body["choices"][0]["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("tool_calls in {body}"))
        .iter()
        .map(|call| {
            assert_eq!(call["type"], "function", "{call}");
            assert!(
                call["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("call_")),
                "{call}"
            );
            let arguments = call["function"]["arguments"]
                .as_str()
                .expect("arguments text");
            (
                call["function"]["name"].as_str().expect("name").to_string(),
                serde_json::from_str(arguments).expect("arguments are JSON"),
            )
        })
        .collect()
}

/// Reads a chat stream: (the content deltas joined, the calls from the `tool_calls`
/// deltas, the last chunk's finish reason).
fn streamed_calls(events: &[String]) -> (String, Vec<(String, Value)>, Value) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    let mut content = String::new();
    let mut calls = Vec::new();
    for chunk in &chunks {
        let delta = &chunk["choices"][0]["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], calls.len(), "{call}");
            assert!(
                call["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("call_")),
                "{call}"
            );
            assert_eq!(call["type"], "function", "{call}");
            let arguments = call["function"]["arguments"]
                .as_str()
                .expect("arguments text");
            calls.push((
                call["function"]["name"].as_str().expect("name").to_string(),
                serde_json::from_str(arguments).expect("arguments are JSON"),
            ));
        }
    }
    let last = chunks.last().expect("chunks");
    (content, calls, last["choices"][0]["finish_reason"].clone())
}

/// The `openai` client's view of a tool-calling request (the request's JSON in
/// `argv[2]`), whole and streamed: finish reasons and `[name, arguments]` of each call.
const OPENAI_TOOLS_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
request = json.loads(sys.argv[2])
answer = client.chat.completions.create(**request)
choice = answer.choices[0]
out = {"finish": choice.finish_reason,
       "calls": [[c.function.name, json.loads(c.function.arguments)] for c in choice.message.tool_calls or []]}
out["streamed"] = []
for chunk in client.chat.completions.create(stream=True, **request):
    for call in chunk.choices[0].delta.tool_calls or []:
        assert call.index == len(out["streamed"]) and call.id.startswith("call_")
        out["streamed"].append([call.function.name, json.loads(call.function.arguments)])
    if chunk.choices[0].finish_reason:
        out["streamed_finish"] = chunk.choices[0].finish_reason
print(json.dumps(out))
"#;

/// The real SmolLM2-135M behind a Hermes-style template written for this test (its own
/// template knows no tools): shown two earlier calls, greedy decoding calls the tool a
/// third time for Paris, and the call comes back parsed, whole and streamed. With
/// `tool_choice` "none" the same output stays text.
#[test]
fn tool_calls_come_back_whole_and_streamed_from_a_real_model() {
    let (_, model) = common::fetch_real_model("smollm2");
    let dir = tempfile::tempdir().expect("temp dir");
    for entry in std::fs::read_dir(&model).expect("model dir") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("file name");
        std::os::unix::fs::symlink(&path, dir.path().join(name)).expect("link");
    }
    // Read before tokenizer_config.json's template.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        HERMES_STYLE_TEMPLATE,
    )
    .expect("template");
    let path = dir.path().to_str().expect("utf-8 path").to_string();
    let server = Server::start_model(&path, Some(dir), "ngram", &[]);
    let body = json!({"model": "tiny", "messages": weather_conversation(),
                      "tools": [weather_tool()], "max_tokens": 48, "temperature": 0});
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let paris = vec![("get_weather".to_string(), json!({"city": "Paris"}))];
    assert_eq!(answered_calls(&whole), paris, "{whole}");
    assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
    assert!(
        whole["choices"][0]["message"]["content"].is_null(),
        "{whole}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (content, calls, finish) =
        streamed_calls(&stream(&server, "/v1/chat/completions", &streamed));
    assert_eq!(content, "", "the call's text is not streamed as content");
    assert_eq!(calls, paris);
    assert_eq!(finish, "tool_calls");

    // The official client reads both shapes into its own types.
    let got = openai_client(&server, OPENAI_TOOLS_SCRIPT, &[&body.to_string()]);
    assert_eq!(got["finish"], "tool_calls", "{got}");
    assert_eq!(
        got["calls"],
        json!([["get_weather", {"city": "Paris"}]]),
        "{got}"
    );
    assert_eq!(got["streamed"], got["calls"], "{got}");
    assert_eq!(got["streamed_finish"], "tool_calls", "{got}");

    let mut none = body.clone();
    none["tool_choice"] = json!("none");
    let (status, text) = server.post("/v1/chat/completions", &none);
    assert_eq!(status, 200, "{text}");
    let content = text["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert!(
        content.contains("<tool_call>") && content.contains("Paris"),
        "{text}"
    );
    assert!(
        text["choices"][0]["message"].get("tool_calls").is_none(),
        "{text}"
    );
    assert_eq!(text["choices"][0]["finish_reason"], "stop");
}

/// Qwen2.5-Coder-0.5B-Instruct through its own template, which defines tools: asked for
/// the weather with a `get_weather` tool, greedy decoding calls it, whole and streamed.
#[test]
fn qwen_calls_a_tool_through_its_own_template() {
    if !std::env::var("DSPEC_HEAVY_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("skipped: set DSPEC_HEAVY_TESTS=1 to fetch and run Qwen2.5-Coder-0.5B-Instruct (0.5 GB)");
        return;
    }
    let (_, model) = common::fetch_real_model("qwen05");
    let server = Server::start_model(model.to_str().expect("utf-8 path"), None, "ngram", &[]);
    let body = json!({"model": "tiny", "tools": [weather_tool()], "max_tokens": 48,
                      "temperature": 0, "messages": [
                          {"role": "user", "content": "What is the weather like in Paris today?"}]});
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let paris = vec![("get_weather".to_string(), json!({"city": "Paris"}))];
    assert_eq!(answered_calls(&whole), paris, "{whole}");
    assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (content, calls, finish) =
        streamed_calls(&stream(&server, "/v1/chat/completions", &streamed));
    assert_eq!(content, "");
    assert_eq!(calls, paris);
    assert_eq!(finish, "tool_calls");
}

/// Sends raw bytes on a fresh connection and returns it, reading with a timeout.
fn raw_connection(server: &Server, bytes: &[u8]) -> TcpStream {
    let mut conn = TcpStream::connect(&server.addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("read timeout");
    conn.write_all(bytes).expect("send");
    conn
}

/// Everything the server sends on `conn` until it closes it.
fn read_to_close(mut conn: TcpStream) -> String {
    let mut text = String::new();
    let _ = conn.read_to_string(&mut text);
    text
}

/// `--api-key`: every route but /health needs `Authorization: Bearer KEY`, answered 401
/// in OpenAI's error shape otherwise; the key may come from DSPEC_API_KEY, and the
/// official `openai` client's `api_key` is that header.
#[test]
fn an_api_key_guards_every_route_but_health() {
    let server = Server::start("ngram", &["--api-key", "s3cret-key"]);
    let body = chat_body(json!({}));
    let (status, err) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 401, "{err}");
    assert_eq!(err["error"]["code"], "missing_api_key", "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Authorization"));
    let send = |path: &str, auth: &str| {
        answer(
            ureq::post(&server.url(path))
                .set("Authorization", auth)
                .send_json(body.clone()),
        )
    };
    let (status, err) = send("/v1/chat/completions", "Bearer s3cret-kez");
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let (status, err) = send("/v1/chat/completions", "s3cret-key");
    assert_eq!(status, 401, "a key without `Bearer`: {err}");
    let (status, answered) = send("/v1/chat/completions", "Bearer s3cret-key");
    assert_eq!(status, 200, "{answered}");
    assert!(answered["choices"][0]["message"]["content"].is_string());
    let (status, err) = server.get("/v1/models");
    assert_eq!(status, 401, "{err}");
    let (status, health) = server.get("/health");
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
    drop(server);

    // The same key from the environment; the openai client sends it as its api_key.
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", 7).expect("tiny model");
    let server = Server::start_with_env(
        dir.path().to_str().unwrap(),
        None,
        "ngram",
        &[],
        &[("DSPEC_API_KEY", "from-the-env")],
    );
    let (status, _) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 401);
    let client = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/openai-client");
    if client.join("openai").is_dir() {
        let out = openai_client(&server, OPENAI_KEY_SCRIPT, &[]);
        assert_eq!(out["right"], true, "{out}");
        assert_eq!(out["wrong"], 401, "{out}");
    }
}

/// The official client with the server's key, then with another one.
const OPENAI_KEY_SCRIPT: &str = r#"
import json, sys, openai
url = sys.argv[1] + "/v1"
messages = [{"role": "user", "content": "hi"}]
right = openai.OpenAI(base_url=url, api_key="from-the-env")
answer = right.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
out = {"right": answer.choices[0].message.content is not None}
try:
    openai.OpenAI(base_url=url, api_key="guess", max_retries=0).chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    out["wrong"] = 200
except openai.AuthenticationError as e:
    out["wrong"] = e.status_code
print(json.dumps(out))
"#;

/// A server started on a non-loopback address without a key says anyone may use it;
/// an empty key is refused.
#[test]
fn serving_other_machines_without_a_key_warns() {
    let server = Server::start("ngram", &["--host", "0.0.0.0"]);
    server.wait_for_log("without --api-key");
    drop(server);
    let dir = tempfile::tempdir().expect("temp dir");
    write_tiny_model(dir.path(), "{}", 7).expect("tiny model");
    let out = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args([
            "serve",
            "--target",
            dir.path().to_str().unwrap(),
            "--drafter",
            "ngram",
        ])
        .args(["--port", "0", "--api-key", " "])
        .output()
        .expect("run dspec serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--api-key"), "{err}");
}

/// Bodies that are not JSON are refused with 415 before they are read as JSON; token
/// ids are a completions prompt, generating what the same prompt as text does.
#[test]
fn a_body_must_be_json_and_a_prompt_may_be_token_ids() {
    let server = Server::start("ngram", &[]);
    let sent = ureq::post(&server.url("/v1/chat/completions"))
        .set("Content-Type", "text/plain")
        .send_string(&chat_body(json!({})).to_string());
    let (status, err) = answer(sent);
    assert_eq!(status, 415, "{err}");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("application/json"));
    let (status, _) = answer(
        ureq::post(&server.url("/v1/chat/completions"))
            .set("Content-Type", "application/json; charset=utf-8")
            .send_string(&chat_body(json!({})).to_string()),
    );
    assert_eq!(status, 200);

    let tokenizer = dspec_engine::text::tokenizer::TextTokenizer::from_dir(std::path::Path::new(
        server._dir.as_ref().unwrap().path(),
    ))
    .expect("the tiny model's tokenizer");
    let text = "abc abc abc";
    let ids = tokenizer.encode_prompt(text, false).expect("ids");
    let complete = |prompt: Value| {
        server.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0}),
        )
    };
    let (status, as_text) = complete(json!(text));
    assert_eq!(status, 200, "{as_text}");
    let (status, as_ids) = complete(json!(ids));
    assert_eq!(status, 200, "{as_ids}");
    assert_eq!(as_text["choices"][0]["text"], as_ids["choices"][0]["text"]);
    let (status, err) = complete(json!([1, 2, 1_000_000]));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "prompt[2]", "{err}");
}

/// A whole request on a fresh connection that closes after the answer; the raw reply.
fn raw_request(server: &Server, path: &str, body: &Value) -> String {
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    read_to_close(raw_connection(server, format!("{head}{body}").as_bytes()))
}

/// A client that sends half its headers or half its body is cut off after
/// --read-timeout, with 408 for the body; others are served meanwhile, and beyond
/// --max-connections a connection waits until one of the slow ones is cut off.
#[test]
fn slow_clients_are_cut_off_and_others_are_served_meanwhile() {
    let server = Server::start("ngram", &["--read-timeout", "3", "--max-connections", "3"]);
    let request = json!({"model": "tiny", "prompt": "hi", "max_tokens": 4});
    let started = Instant::now();
    let half_headers = raw_connection(&server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
    let half_body = raw_connection(
        &server,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    );
    // The third slot: a whole request, answered while the others stall.
    let reply = raw_request(&server, "/v1/completions", &request);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    // Served while the slow client still held its connection: nothing has come back on
    // it yet, and it is open.
    half_body.set_nonblocking(true).expect("non-blocking");
    let held = half_body.peek(&mut [0u8; 1]);
    assert!(
        matches!(&held, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the slow client was answered before the others were served: {held:?}"
    );
    half_body.set_nonblocking(false).expect("blocking");
    // An idle connection takes the third slot again; a request past the limit waits
    // until a slow client is cut off, and is then answered.
    std::thread::sleep(Duration::from_millis(100));
    let idle = raw_connection(&server, b"");
    let waiting = Instant::now();
    let reply = raw_request(&server, "/v1/completions", &request);
    let waited = waiting.elapsed();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(
        waited > Duration::from_millis(500),
        "the connection past the limit was accepted at once ({waited:?})"
    );
    let body_reply = read_to_close(half_body);
    assert!(body_reply.starts_with("HTTP/1.1 408"), "{body_reply}");
    assert!(body_reply.contains("--read-timeout"), "{body_reply}");
    let header_reply = read_to_close(half_headers);
    assert!(!header_reply.contains(" 200 "), "{header_reply}");
    read_to_close(idle);
    let cut = started.elapsed();
    assert!(cut < Duration::from_secs(15), "cut off after {cut:?}");
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
}

/// SIGTERM stops the server the graceful way: it says so, lets a stream in flight
/// finish within its grace period (it ends with `[DONE]`), and exits successfully.
#[test]
fn a_stopped_server_finishes_what_it_serves_and_says_so() {
    let mut server = Server::start("ngram", &[]);
    let stream = open_stream(
        &server,
        &json!({"model": "tiny", "prompt": "count", "max_tokens": 200, "temperature": 0, "stream": true}),
    );
    let signalled = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(signalled.success());
    let rest = read_to_close(stream);
    assert!(rest.contains("[DONE]"), "the stream was cut: {rest}");
    let stopping = Instant::now();
    let status = loop {
        if let Some(status) = server.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            stopping.elapsed() < Duration::from_secs(20),
            "still running"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    server.wait_for_log("shutting down");
    server.wait_for_log("every request finished");
}

/// Reads a streamed completion on `socket` to its end; returns its text and the number
/// of tokens it says it generated.
fn finish_stream(mut socket: TcpStream) -> (String, u64) {
    socket
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let mut raw = String::new();
    socket.read_to_string(&mut raw).expect("read the stream");
    let mut text = String::new();
    let mut tokens = 0;
    for line in raw.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    (text, tokens)
}

/// Requests decoded together (`--max-batch 4`, n-gram drafts on) answer each client what
/// it gets alone (`--max-batch 1`), greedy, whole and streamed, with clients arriving
/// while others decode.
#[test]
fn requests_decoded_together_get_what_they_get_one_at_a_time() {
    let prompts: Vec<String> = (0..8)
        .map(|i| match i % 3 {
            0 => format!("client {i}: the cat sat on the mat, the cat sat on the"),
            1 => format!("client {i} asks for a story"),
            _ => format!("{i}, {}, {}, {},", i + 1, i + 2, i + 3),
        })
        .collect();
    let body = |i: usize| {
        json!({"model": "tiny", "messages": [{"role": "user", "content": prompts[i]}],
               "max_tokens": 10 + 4 * i, "temperature": 0})
    };
    let alone_server = Server::start_on(BIGGER, "ngram", &["--max-batch", "1"]);
    alone_server.wait_for_log("(batch 1,");
    let alone: Vec<Value> = (0..8)
        .map(|i| {
            let (status, answer) = alone_server.post("/v1/chat/completions", &body(i));
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["message"]["content"].clone()
        })
        .collect();
    drop(alone_server);
    let server = Arc::new(Server::start_on(
        BIGGER,
        "ngram",
        &["--max-batch", "4", "--queue-size", "8"],
    ));
    server.wait_for_log("(batch 4,");
    let (answers_tx, answers) = channel();
    for i in 0..8 {
        let server = server.clone();
        let answers_tx = answers_tx.clone();
        let mut request = body(i);
        std::thread::spawn(move || {
            // Arrivals spread over the first steps, half of them streamed.
            std::thread::sleep(Duration::from_millis(15 * i as u64));
            let text = if i % 2 == 0 {
                request["stream"] = json!(true);
                let events = stream(&server, "/v1/chat/completions", &request);
                let text: String = events
                    .iter()
                    .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                    .filter_map(|c| {
                        c["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(String::from)
                    })
                    .collect();
                json!(text)
            } else {
                let (status, answer) = server.post("/v1/chat/completions", &request);
                assert_eq!(status, 200, "{answer}");
                answer["choices"][0]["message"]["content"].clone()
            };
            let _ = answers_tx.send((i, text));
        });
    }
    drop(answers_tx);
    for _ in 0..8 {
        let (i, text) = answers
            .recv_timeout(Duration::from_secs(120))
            .expect("every client is answered");
        assert_eq!(text, alone[i], "client {i}: its text alone");
    }
}

/// A DFlash drafter served with `--max-batch 4`: requests decode together (each with a
/// fork of the drafter) and every client gets what it gets one at a time.
#[test]
fn a_dflash_server_batches_and_answers_as_one_at_a_time() {
    let drafter = tempfile::tempdir().expect("temp dir");
    dspec_drafters::dflash::write_random_checkpoint(
        drafter.path(),
        dspec_drafters::dflash::TINY_DFLASH,
        3,
    )
    .expect("a DFlash checkpoint");
    batches_and_answers_as_one_at_a_time(drafter.path().to_str().expect("utf-8 path"));
}

/// A draft model (`model:DIR`, the target itself) served with `--max-batch 4`: requests
/// decode together, each with a fork of the drafter on a thread of its own, and every
/// client gets what it gets one at a time.
#[test]
fn a_draft_model_server_batches_and_answers_as_one_at_a_time() {
    batches_and_answers_as_one_at_a_time("model:{dir}");
}

/// `dspec serve --drafter drafter` with `--max-batch 4` reports a batch of 4, and four
/// clients arriving while others decode get what each gets from `--max-batch 1`.
fn batches_and_answers_as_one_at_a_time(drafter: &str) {
    let body = |i: usize| {
        json!({"model": "tiny", "prompt": format!("client {i}: the cat sat on the mat"),
               "max_tokens": 6 + 3 * i, "temperature": 0})
    };
    let alone_server = Server::start(drafter, &["--max-batch", "1"]);
    alone_server.wait_for_log("(batch 1,");
    let alone: Vec<Value> = (0..4)
        .map(|i| {
            let (status, answer) = alone_server.post("/v1/completions", &body(i));
            assert_eq!(status, 200, "{answer}");
            answer["choices"][0]["text"].clone()
        })
        .collect();
    drop(alone_server);
    let server = Arc::new(Server::start(drafter, &["--max-batch", "4"]));
    server.wait_for_log("(batch 4,");
    let (answers_tx, answers) = channel();
    for i in 0..4 {
        let (server, answers_tx) = (server.clone(), answers_tx.clone());
        let request = body(i);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10 * i as u64));
            let (status, answer) = server.post("/v1/completions", &request);
            assert_eq!(status, 200, "{answer}");
            let _ = answers_tx.send((i, answer["choices"][0]["text"].clone()));
        });
    }
    drop(answers_tx);
    for _ in 0..4 {
        let (i, text) = answers
            .recv_timeout(Duration::from_secs(120))
            .expect("every client is answered");
        assert_eq!(text, alone[i], "client {i}: its text alone");
    }
}

/// `--max-batch 2 --queue-size 1`: two long generations run at once, a third waits in
/// the queue, a fourth is refused with 429. When one of the two running leaves, the
/// waiting one starts, and the other runs on to the same end it reaches alone.
#[test]
fn a_full_batch_queues_then_refuses_and_a_client_leaving_spares_the_others() {
    let server = Server::start_on(BIGGER, "ngram", &["--max-batch", "2", "--queue-size", "1"]);
    server.wait_for_log("(batch 2,");
    let mut long = long_request();
    let (status, alone) = server.post("/v1/completions", &long);
    assert_eq!(status, 200, "{alone}");
    long["stream"] = json!(true);
    let first = open_stream(&server, &long);
    // Streaming text while the first is: both in one batch.
    let second = open_stream(&server, &long);
    let third = send_completion(&server, &long);
    std::thread::sleep(Duration::from_millis(300));
    let (status, refused) = server.post("/v1/completions", &long_request());
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["type"], "rate_limit_error", "{refused}");
    drop(first);
    server.wait_for_log("client went away");
    let (third_text, third_tokens) = finish_stream(third);
    let (second_text, second_tokens) = finish_stream(second);
    let alone = alone["choices"][0]["text"].as_str().expect("text");
    assert_eq!(
        (third_text.as_str(), third_tokens),
        (alone, 1000),
        "the one that waited"
    );
    // Its first pieces were read to see it start.
    assert_eq!(second_tokens, 1000, "the one running on");
    assert!(
        !second_text.is_empty() && alone.ends_with(&second_text),
        "the one running on: {second_text:?}"
    );
}

/// Eight chat requests through the official `openai` client, one after another and then
/// all at once from eight threads: the same texts.
const OPENAI_CONCURRENT_SCRIPT: &str = r#"
import json, sys, threading
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
prompts = [f"Tell me one fact about the number {i}." for i in range(8)]
def ask(prompt):
    answer = client.chat.completions.create(model="tiny", max_tokens=32, temperature=0,
        messages=[{"role": "user", "content": prompt}])
    return answer.choices[0].message.content
alone = [ask(p) for p in prompts]
together = [None] * len(prompts)
def run(i):
    together[i] = ask(prompts[i])
threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"alone": alone, "together": together}))
"#;

/// The real SmolLM2-135M served with `--max-batch 8` and n-gram drafts: eight clients at
/// once get the texts they get one at a time.
#[test]
fn eight_openai_clients_at_once_get_what_they_get_one_at_a_time_on_a_real_model() {
    let server = Server::start_smollm2(&["--max-batch", "8"]);
    server.wait_for_log("(batch 8,");
    let got = openai_client(&server, OPENAI_CONCURRENT_SCRIPT, &[]);
    let alone = got["alone"].as_array().expect("texts");
    assert_eq!(alone.len(), 8);
    assert!(
        alone
            .iter()
            .all(|t| !t.as_str().unwrap_or("").trim().is_empty()),
        "{got}"
    );
    assert_eq!(got["together"], got["alone"]);
}
