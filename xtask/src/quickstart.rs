//! `cargo xtask quickstart [--serve] [--port N] [--hw HW]`: a new user's first command. Fetches the
//! default model (`fetch-model smollm2-135m`), builds this machine's target through the same code path
//! as `build-target` (`cpu` here; `h200` when `nvidia-smi` reports an H200, after installing the pinned
//! toolchain), starts the built `metrale-server` on a free loopback port, waits for `/health`, asks
//! the reference question (docs/facts.md) over real HTTP (`/v1/chat/completions`, greedy), prints
//! the answer and stops the server; `--serve` keeps it running until Ctrl-C.
//!
//! Invariant: the server child is killed on every exit path (a guard owns it), except with `--serve`,
//! where it is waited on.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};

/// The question every quickstart asks (docs/facts.md, "The reference question"; its greedy answer
/// names Paris).
pub const QUESTION: &str = "What is the capital of France? Answer in one sentence.";
const MODEL: &str = "smollm2-135m";
const QUANT: &str = "q4_1";

#[derive(clap::Args)]
pub struct Args {
    /// Keep the server running after the answer (until Ctrl-C).
    #[arg(long)]
    pub serve: bool,
    /// Port to serve on (default: a free port; 8080 with --serve).
    #[arg(long)]
    pub port: Option<u16>,
    /// Hardware target to build (default: detected: h200 when nvidia-smi reports an H200, else cpu).
    #[arg(long)]
    pub hw: Option<String>,
}

/// Kills the server child when dropped.
struct ServerGuard(Option<Child>);
impl Drop for ServerGuard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `h200` when `nvidia-smi` names an H200, else `cpu`.
pub fn detect_hw() -> String {
    let out = Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output();
    match out {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("H200") => {
            "h200".into()
        }
        _ => "cpu".into(),
    }
}

fn step(n: usize, what: &str) {
    eprintln!("\n[{n}/4] {what}");
}

pub fn run(args: Args) -> Result<()> {
    let t0 = Instant::now();
    let hw = args.hw.clone().unwrap_or_else(detect_hw);
    let repo = crate::build_target::repo_root()?;

    step(1, &format!("model: cargo xtask fetch-model {MODEL}"));
    let model = crate::fetch_model::fetch(MODEL, false)?;
    eprintln!("model at {}", model.display());

    step(
        2,
        &format!("build: cargo xtask build-target --hw {hw} --model {MODEL} --quant {QUANT}"),
    );
    let spec = metrale_core::target::TargetSpec::load(
        &repo.join("targets"),
        &metrale_core::target::TargetId::new(&hw, MODEL, QUANT),
    )
    .with_context(|| format!("no target {hw}/{MODEL}/{QUANT}; see `cargo xtask list-targets`"))?;
    if spec.hardware.backend == metrale_core::target::BackendKind::Cuda {
        eprintln!("installing the pinned CUDA compiler (cargo xtask toolchain) ...");
        #[derive(Parser)]
        struct Toolchain {
            #[command(flatten)]
            args: crate::toolchain::Args,
        }
        crate::toolchain::run(Toolchain::try_parse_from(["toolchain"])?.args)
            .context("cargo xtask toolchain")?;
    }
    let out = repo.join("dist").join(format!("{hw}-{MODEL}-{QUANT}"));
    crate::build_target::run(crate::build_target::Args {
        hw: hw.clone(),
        model: MODEL.into(),
        quant: QUANT.into(),
        out: Some(out.clone()),
        kernels_only: false,
        repo: None,
        jobs: None,
        cache: None,
    })
    .with_context(|| format!("building target {hw}/{MODEL}/{QUANT}"))?;
    let binary = out.join("metrale-server");
    if !binary.is_file() {
        bail!("build-target finished but {} is missing", binary.display());
    }

    step(3, "serve: metrale-server --model ...");
    let port = match args.port {
        Some(p) => p,
        None if args.serve => 8080,
        None => std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port(),
    };
    let base = format!("http://127.0.0.1:{port}");
    let mut guard = ServerGuard(Some(start_server(&binary, &model, port)?));
    wait_healthy(
        &base,
        guard.0.as_mut().expect("started"),
        Duration::from_secs(300),
    )?;

    step(4, &format!("ask: POST {base}/v1/chat/completions"));
    eprintln!("Q: {QUESTION}");
    let t = Instant::now();
    let answer = ask(&base)?;
    println!("{answer}");
    eprintln!(
        "(answered in {:.1} s; quickstart took {:.0} s in all)",
        t.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );

    if args.serve {
        eprintln!(
            "\nserving the OpenAI API at {base}/v1 (Ctrl-C stops it). Try:\n  curl {base}/v1/chat/completions \
             -H 'Content-Type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
        );
        let mut child = guard.0.take().expect("started");
        let status = child.wait()?;
        if !status.success() {
            bail!("the server exited with {status}");
        }
    }
    Ok(())
}

fn start_server(binary: &PathBuf, model: &PathBuf, port: u16) -> Result<Child> {
    Command::new(binary)
        .arg("--model")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))
}

fn wait_healthy(base: &str, child: &mut Child, timeout: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("the server exited during start-up ({status}); its error is printed above");
        }
        if let Ok(r) = ureq::get(format!("{base}/health")).call() {
            if r.status() == 200 {
                return Ok(());
            }
        }
        if t.elapsed() > timeout {
            bail!("the server was not healthy after {timeout:?} (GET {base}/health)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Ask the question greedily and return the answer text.
fn ask(base: &str) -> Result<String> {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 64,
    });
    let mut resp = ureq::post(format!("{base}/v1/chat/completions"))
        .config()
        .http_status_as_error(false)
        .build()
        .send_json(&body)
        .context("POST /v1/chat/completions")?;
    let status = resp.status();
    let v: Value = resp
        .body_mut()
        .read_json()
        .context("reading the chat response")?;
    if status != 200 {
        bail!("the server answered {status}: {v}");
    }
    v["choices"][0]["message"]["content"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no answer in the response: {v}"))
}
