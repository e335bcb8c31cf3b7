// The npm `ollama` client against a daemon: over TCP with a key, or over the Unix socket
// (undici's socketPath). Prints one JSON document of what the client got, for the test to check.
// Usage: node ollama_client.mjs HOST KEY ADMIN_KEY SOCKET (KEY, ADMIN_KEY, SOCKET may be "-").
import { Ollama } from "ollama";
import { Agent } from "undici";

const [host, key, adminKey, socketPath] = process.argv.slice(2);

function client(withKey) {
  const config = { host };
  if (withKey !== "-") config.headers = { Authorization: `Bearer ${withKey}` };
  if (socketPath !== "-") {
    const dispatcher = new Agent({ connect: { socketPath } });
    config.fetch = (url, init) => fetch(url, { ...init, dispatcher });
  }
  return new Ollama(config);
}

async function refusal(promise) {
  try {
    await promise;
    return null;
  } catch (e) {
    return { status: e.status_code ?? null, error: e.error ?? String(e) };
  }
}

const use = client(key);
const admin = client(adminKey);
const out = {};
out.version = await use.version();
out.tags = (await use.list()).models.map((m) => m.model);
const shown = await use.show({ model: "tiny-text:latest" });
out.capabilities = shown.capabilities;
out.context_length = shown.model_info[`${shown.model_info["general.architecture"]}.context_length`];
const parts = [];
for await (const part of await use.chat({
  model: "tiny-text",
  messages: [{ role: "user", content: "hello" }],
  stream: true,
  options: { num_predict: 3 },
})) {
  parts.push(part);
}
out.chat_parts = parts.length;
out.chat_last = parts[parts.length - 1];
out.chat_text = parts.map((p) => p.message.content).join("");
out.generate = await use.generate({ model: "tiny-text", prompt: "hi", options: { num_predict: 2 } });
out.embed = (await use.embed({ model: "tiny-embed", input: ["a", "b"] })).embeddings.length;
out.ps = (await use.ps()).models.map((m) => m.model);
out.pull_as_use = await refusal(use.pull({ model: "tiny-text" }));
const statuses = [];
for await (const p of await admin.pull({ model: "tiny-text", stream: true })) {
  statuses.push(p.status);
}
out.pull_statuses = statuses;
out.unknown = await refusal(use.chat({ model: "no-such-model", messages: [] }));
console.log(JSON.stringify(out));
