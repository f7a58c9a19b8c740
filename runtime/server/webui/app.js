// The chat page: the conversation goes to the server's own /v1/chat/completions as a stream, and
// each answer is shown as its tokens arrive, with its speed (tokens after the first over the time
// since the first) and the time to its first token. Served by runtime/server/src/webui.rs under a
// Content-Security-Policy that allows this script and the same-origin API calls alone.
"use strict";

const $ = (id) => document.getElementById(id);
let history = [];
let model = null;

function headers() {
  const h = { "content-type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) {
      $("model").textContent = r.status === 401 ? "enter the API key" : "model: HTTP " + r.status;
      return;
    }
    const m = (await r.json()).data[0];
    model = m.id;
    $("model").textContent = m.id;
    $("target").textContent = m.target ? "target " + m.target : "generic build (CPU)";
  } catch (e) {
    $("model").textContent = "the server is unreachable";
  }
}

function bubble(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.textContent = text;
  $("log").appendChild(d);
  d.scrollIntoView({ block: "end" });
  return d;
}

// Read an SSE body: call `onData` with each `data:` payload.
async function readEvents(body, onData) {
  const reader = body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of frame.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onData(JSON.parse(line.slice(6)));
      }
    }
  }
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  $("prompt").value = "";
  $("send").disabled = true;
  history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  const t0 = performance.now();
  let first = null;
  let usage = null;
  let answer = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({
        model: model || "default",
        messages: history,
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (!r.ok) {
      const e = await r.json().catch(() => null);
      throw new Error(e && e.error ? e.error.message : "HTTP " + r.status);
    }
    await readEvents(r.body, (c) => {
      if (c.error) throw new Error(c.error.message);
      if (c.usage) usage = c.usage;
      for (const ch of c.choices || []) {
        const d = ch.delta && ch.delta.content;
        if (d) {
          if (first === null) first = performance.now();
          answer += d;
          out.textContent = answer;
          out.scrollIntoView({ block: "end" });
        }
      }
    });
    history.push({ role: "assistant", content: answer });
    const t1 = performance.now();
    if (usage) {
      const n = usage.completion_tokens;
      const rate = first !== null && n > 1 && t1 > first ? (n - 1) / ((t1 - first) / 1000) : null;
      $("stats").textContent =
        n + " tokens" + (rate ? ", " + rate.toFixed(1) + " tokens/s" : "") +
        ", first token after " + ((first ?? t1) - t0).toFixed(0) + " ms";
    }
  } catch (e) {
    out.classList.add("error");
    out.textContent = "error: " + e.message;
    history.pop();
  } finally {
    out.classList.remove("streaming");
    out.dataset.done = "1";
    $("send").disabled = false;
    $("prompt").focus();
  }
}

$("ask").addEventListener("submit", send);
$("key").addEventListener("change", loadModel);
$("clear").addEventListener("click", () => {
  history = [];
  $("log").replaceChildren();
  $("stats").textContent = "";
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
loadModel();
