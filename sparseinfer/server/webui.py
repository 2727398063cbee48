"""The chat page served at `/`: plain HTML + JS, no external assets.

It posts the conversation to /v1/chat/completions with `stream: true` and parses the SSE reply
from `fetch`'s body stream. Stop aborts the fetch, which the server sees as a disconnect.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sparseinfer chat</title>
<style>
  body { font: 15px/1.45 system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #222; }
  header { padding: 8px 16px; background: #2d3e50; color: #fff; display: flex; gap: 12px;
           align-items: center; flex-wrap: wrap; }
  header h1 { font-size: 16px; margin: 0 12px 0 0; }
  header label { font-size: 13px; }
  header input { width: 70px; }
  header input#api-key { width: 160px; }
  #log { max-width: 820px; margin: 0 auto; padding: 16px 16px 140px; }
  .msg { white-space: pre-wrap; padding: 10px 14px; margin: 10px 0; border-radius: 10px; }
  .msg.user { background: #dde8f5; margin-left: 15%; }
  .msg.assistant { background: #fff; border: 1px solid #ddd; margin-right: 15%; }
  .msg.error { background: #fbe3e3; border: 1px solid #e0a0a0; }
  .meta { font-size: 12px; color: #777; margin-top: 4px; }
  form { position: fixed; bottom: 0; left: 0; right: 0; background: #eee; padding: 10px;
         display: flex; gap: 8px; justify-content: center; border-top: 1px solid #ccc; }
  textarea { width: min(680px, 70vw); height: 56px; font: inherit; padding: 6px; }
  button { font: inherit; padding: 0 18px; }
</style>
</head>
<body>
<header>
  <h1>sparseinfer</h1>
  <span id="model"></span>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7"></label>
  <label>max tokens <input id="max-tokens" type="number" min="1" value="256"></label>
  <label>API key <input id="api-key" type="password" placeholder="(none)"></label>
  <button id="reset" type="button">New chat</button>
</header>
<div id="log"></div>
<form id="form">
  <textarea id="input" placeholder="Type a message; Enter sends, Shift+Enter adds a line"></textarea>
  <button id="send" type="submit">Send</button>
  <button id="stop" type="button" disabled>Stop</button>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input");
let messages = [], controller = null;

$("api-key").value = localStorage.getItem("sparseinfer-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("sparseinfer-api-key", $("api-key").value);
  showModel();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function showModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    $("model").textContent = r.ok ? body.data[0].id : "";
  } catch (e) { $("model").textContent = ""; }
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  log.appendChild(div);
  window.scrollTo(0, document.body.scrollHeight);
  return div;
}

// Yields the JSON payload of each `data:` event in an SSE body; stops at [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\\n\\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  messages.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  let reply = "", finish = null, usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages, stream: true, stream_options: { include_usage: true },
        temperature: parseFloat($("temperature").value), max_tokens: parseInt($("max-tokens").value, 10),
      }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || ("HTTP " + r.status));
    }
    for await (const chunk of sseEvents(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        out.textContent = reply;
        window.scrollTo(0, document.body.scrollHeight);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    messages.push({ role: "assistant", content: reply });
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = (finish === "length" ? "[cut at max tokens] " : "") +
      (usage ? usage.completion_tokens + " tokens" : "");
    out.appendChild(meta);
  } catch (e) {
    if (e.name === "AbortError") {
      messages.push({ role: "assistant", content: reply });
    } else {
      messages.pop();
      out.classList.add("error");
      out.textContent = (reply ? reply + "\\n" : "") + "error: " + e.message;
    }
  } finally {
    out.classList.remove("streaming");
    out.classList.add("done");
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
    input.focus();
  }
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("reset").addEventListener("click", () => {
  if (controller) controller.abort();
  messages = []; log.textContent = "";
});
showModel();
input.focus();
</script>
</body>
</html>
"""
