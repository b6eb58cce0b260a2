// A trainer's read and commit of one batch, written from docs/stream-format.md alone, in
// Node.js with nothing but the standard library: RESP over a raw TCP socket, no package.
//
//   node trainer.mjs <host> <port> <run> <consumer>
//
// Start-up (§11.1), one step's batch of each task's quota (§10, §11.2 step 3), each group
// decoded (§5.2, packed little-endian int32 / float32), checked (§5.2.2) and committed with
// the page's COMMIT script (§11.5) or, when the run keeps an archive, COMMIT_LOGGED (§13),
// both read from the page itself; then train_step is moved (§11.5). Prints one JSON line:
// what it read and committed.
import { readFileSync } from "node:fs";
import net from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const [host, port, run, me] = process.argv.slice(2);
const base = `rs:{${run}}`;
const page = readFileSync(join(dirname(fileURLToPath(import.meta.url)), "../../../docs/stream-format.md"), "utf8");

function luaBlocks(heading) {
  // the ```lua blocks of the section whose heading starts with `heading`, to the next heading
  const lines = page.split("\n");
  const out = [];
  let inSection = false, fenced = false, block = null;
  for (const line of lines) {
    if (line.startsWith("```")) {
      if (block !== null && line === "```") { out.push(block.join("\n") + "\n"); block = null; fenced = false; continue; }
      fenced = !fenced;
      if (inSection && line === "```lua") block = [];
      continue;
    }
    if (block !== null) { block.push(line); continue; }
    const m = !fenced && /^#+ (\S+)/.exec(line);
    if (m) inSection = m[1] === heading;
  }
  return out;
}

// --- RESP ------------------------------------------------------------------------------

function encode(args) {
  const parts = [Buffer.from(`*${args.length}\r\n`)];
  for (const a of args) {
    const b = Buffer.isBuffer(a) ? a : Buffer.from(String(a));
    parts.push(Buffer.from(`$${b.length}\r\n`), b, Buffer.from("\r\n"));
  }
  return Buffer.concat(parts);
}

class RedisError extends Error {}

function parse(buf, pos) {
  // returns [value, next position] or null when the buffer holds no whole reply yet
  if (pos >= buf.length) return null;
  const end = buf.indexOf("\r\n", pos);
  if (end < 0) return null;
  const type = String.fromCharCode(buf[pos]);
  const line = buf.subarray(pos + 1, end).toString();
  if (type === "+") return [line, end + 2];
  if (type === "-") return [new RedisError(line), end + 2];
  if (type === ":") return [Number(line), end + 2];
  if (type === "$") {
    const n = Number(line);
    if (n < 0) return [null, end + 2];
    if (buf.length < end + 2 + n + 2) return null;
    return [buf.subarray(end + 2, end + 2 + n), end + 2 + n + 2];
  }
  if (type === "*") {
    const n = Number(line);
    if (n < 0) return [null, end + 2];
    const items = [];
    let p = end + 2;
    for (let i = 0; i < n; i++) {
      const r = parse(buf, p);
      if (r === null) return null;
      items.push(r[0]);
      p = r[1];
    }
    return [items, p];
  }
  throw new Error(`unknown RESP type ${type}`);
}

class Client {
  constructor(sock) { this.sock = sock; this.buf = Buffer.alloc(0); this.waiting = []; 
    sock.on("data", (d) => { this.buf = Buffer.concat([this.buf, d]); this.drain(); }); }
  drain() {
    while (this.waiting.length) {
      const r = parse(this.buf, 0);
      if (r === null) return;
      this.buf = this.buf.subarray(r[1]);
      const { resolve, reject } = this.waiting.shift();
      r[0] instanceof RedisError ? reject(r[0]) : resolve(r[0]);
    }
  }
  call(...args) {
    return new Promise((resolve, reject) => { this.waiting.push({ resolve, reject }); this.sock.write(encode(args)); });
  }
}

const text = (b) => (b === null ? null : b.toString("utf8"));
const fieldsOf = (flat) => { const f = {}; for (let i = 0; i < flat.length; i += 2) f[text(flat[i])] = flat[i + 1]; return f; };

// --- the page --------------------------------------------------------------------------

function quotas(batchSize, weights) { // §10: largest remainder, earlier tasks first on a tie
  const tasks = Object.keys(weights);
  const total = tasks.reduce((s, t) => s + weights[t], 0);
  const share = tasks.map((t) => (batchSize * weights[t]) / total);
  const sizes = share.map(Math.floor);
  const order = tasks.map((_, i) => i).sort((a, b) => (share[b] - sizes[b]) - (share[a] - sizes[a]) || a - b);
  for (const i of order.slice(0, batchSize - sizes.reduce((s, x) => s + x, 0))) sizes[i] += 1;
  return Object.fromEntries(tasks.map((t, i) => [t, sizes[i]]));
}

function decode(f, task) { // §5.2, with §5.2.2's dead-letter checks; throws on a bad entry
  const version = text(f.format ?? Buffer.from("1.0"));
  if (version.split(".")[0] !== "1") throw new Error(`format ${version}: this trainer reads 1.x`);
  if (text(f.task) !== task) throw new Error(`task ${text(f.task)} in a stream of ${task}`);
  if (text(f.status) !== "completed") throw new Error(`status ${text(f.status)}`);
  const meta = JSON.parse(text(f.meta));
  const ids = (b) => { const a = []; for (let i = 0; i + 4 <= b.length; i += 4) a.push(b.readInt32LE(i)); return a; };
  const floats = (b) => { const a = []; for (let i = 0; i + 4 <= b.length; i += 4) a.push(b.readFloatLE(i)); return a; };
  const prompt = ids(f.prompt_ids), response = ids(f.response_ids), logprobs = floats(f.logprobs);
  let r = 0, l = 0, p = 0, oldest = Infinity;
  const samples = meta.samples.map((s) => {
    if (s.status !== "completed") throw new Error(`a sample of status ${s.status}`);
    const sPrompt = meta.shared_prompt ? prompt : prompt.slice(p, (p += s.plen));
    const sResponse = response.slice(r, (r += s.len));
    const sLogprobs = logprobs.slice(l, (l += s.lp));
    const versions = s.ver.flatMap(([v, c]) => Array(c).fill(v));
    if (versions.length !== s.len) throw new Error("version runs do not sum to len");
    for (const v of versions) oldest = Math.min(oldest, v);
    return { prompt: sPrompt.length, response: sResponse.length, logprobs: sLogprobs.length,
             score: s.reward?.score ?? null };
  });
  if (r !== response.length || l !== logprobs.length || (!meta.shared_prompt && p !== prompt.length))
    throw new Error("the samples do not use up the packed fields");
  const modelStep = Number(text(f.model_step));
  if (oldest !== Infinity && modelStep !== oldest) throw new Error(`model_step ${modelStep} is not ${oldest}`);
  return { groupId: text(f.group_id), modelStep, samples };
}

const sock = net.connect(Number(port), host);
await new Promise((ok, fail) => { sock.once("connect", ok); sock.once("error", fail); });
const r = new Client(sock);
try {
  // §11.1
  const state = fieldsOf(await r.call("HGETALL", `${base}:state`));
  const version = text(state.format ?? Buffer.from("1.0"));
  if (version.split(".")[0] !== "1") throw new Error(`run in format ${version}`);
  const published = JSON.parse(text(state.settings));
  const shared = published.settings;
  const keep = Number(published.protocol?.["archive.keep"] ?? 0);
  const tasks = shared.tasks.split(",");
  const quota = quotas(Number(shared["rollout.batch_size"]), Object.fromEntries(tasks.map((t) => [t, Number(shared[`tasks.${t}.weight`])])));
  const threshold = (Number(shared["rollout.max_staleness"]) + 1) * Number(shared["rollout.sync_weights_interval"]);
  const step = Number(text(state.train_step ?? Buffer.from("0"))) + 1;
  for (const task of tasks) {
    try { await r.call("XGROUP", "CREATE", `${base}:groups:${task}`, "trainer", "0", "MKSTREAM"); }
    catch (e) { if (!String(e.message).startsWith("BUSYGROUP")) throw e; }
  }
  const [commit, advance] = luaBlocks("11.5");
  const [commitLogged] = luaBlocks("13.");
  const out = { step, keep, tasks: {} };
  const deadline = Date.now() + 30_000;
  for (const task of tasks) {
    const stream = `${base}:groups:${task}`;
    const groups = [];
    while (groups.length < quota[task]) {
      if (Date.now() > deadline) throw new Error(`step ${step}: ${groups.length} of ${quota[task]} groups`);
      // §11.2 step 3: new groups (a first start: nothing of our own is pending)
      const reply = await r.call("XREADGROUP", "GROUP", "trainer", me, "COUNT", quota[task] - groups.length,
                                 "BLOCK", 100, "STREAMS", stream, ">");
      for (const [id, flat] of reply ? reply[0][1] : []) {
        const group = decode(fieldsOf(flat), task);
        if (step - group.modelStep - 1 >= threshold) throw new Error(`${group.groupId} is stale`);
        groups.push({ id: text(id), ...group });
      }
    }
    const ids = groups.map((g) => g.id);
    let foreign;
    if (keep > 0) {
      [foreign] = await r.call("EVAL", commitLogged, 3, stream, `${base}:progress`, `${base}:trained:${task}`,
                               "trainer", me, `${task}:consumed`, step, String(Date.now() / 1000), keep, ...ids);
    } else {
      foreign = await r.call("EVAL", commit, 2, stream, `${base}:progress`, "trainer", me, `${task}:consumed`, ...ids);
    }
    out.tasks[task] = { ids, groupIds: groups.map((g) => g.groupId), foreign: foreign.map(text),
                        samples: groups.map((g) => g.samples.length), scores: groups.flatMap((g) => g.samples.map((s) => s.score)) };
  }
  await r.call("EVAL", advance, 1, `${base}:state`, "train_step", step);
  process.stdout.write(JSON.stringify(out) + "\n");
} finally {
  sock.end();
}
