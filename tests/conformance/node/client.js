// A weightsync receiver in Node, written from docs/protocol.md and the .proto alone
// (@grpc/grpc-js, @grpc/proto-loader; no generated code, no weightsync import).
//
//   node client.js checksum < HEX
//       the bucket checksum (ws-rows64k-v3) of the bytes written in hex on stdin
//   node client.js receive --proto PATH --address unix:/path [--address ...] [--receiver-id ID]
//                          [--versions N] [--leave]
//       register (with every sender given: a version split over several senders, §4.1, is
//       joined from their parts), apply N versions from shm staging buffers (checksums
//       verified; manifests kept by key, §2.1), print one JSON line per version with every
//       tensor's bytes, then leave in
//       order (half-close, read each stream to its end): when stdin closes, or at once with
//       --leave. The last line says the status each sender ended its stream with.
//
// Output: JSON lines on stdout.
'use strict';

const fs = require('fs');

const ALIGNMENT = 256;
const CHECKSUM_ALGORITHM = 'ws-rows64k-v3';
const ROW_WORDS = 8192; // 64 KiB rows
const TAIL_ROW_WORDS = ALIGNMENT / 8; // 256-byte rows for the tail
const K_POSITIONAL = 0x9e3779b97f4a7c15n;
const K_PLAIN = 0xc2b2ae3d27d4eb4fn;
const MASK = (1n << 64n) - 1n;
const KEYS_KEPT = 16; // of each kind per stream (§2.1)
const ITEMSIZE = {
  bool: 1, uint8: 1, int8: 1, int16: 2, int32: 4, int64: 8, float16: 2, bfloat16: 2,
  float32: 4, float64: 8, float8_e4m3fn: 1, float8_e5m2: 1,
};

/** ws-rows64k-v3 of buf[0, nbytes): a BigInt in [0, 2^64). */
function checksum(buf, nbytes) {
  if (nbytes % ALIGNMENT !== 0) throw new Error(`checksum length ${nbytes} is not a multiple of 256`);
  if (nbytes === 0) return 0n;
  const words = nbytes / 8;
  const whole = Math.floor(words / ROW_WORDS) * ROW_WORDS;
  let positional = 0n;
  let plain = 0n;
  let row = 0n;
  const addRow = (first, count) => {
    let sum = 0n;
    for (let w = first; w < first + count; w++) sum += buf.readBigUInt64LE(w * 8);
    sum &= MASK;
    row += 1n;
    positional += sum * row;
    plain += sum;
  };
  for (let w = 0; w < whole; w += ROW_WORDS) addRow(w, ROW_WORDS);
  for (let w = whole; w < words; w += TAIL_ROW_WORDS) addRow(w, TAIL_ROW_WORDS);
  positional &= MASK;
  plain &= MASK;
  return (positional * K_POSITIONAL + plain * K_PLAIN + BigInt(nbytes)) & MASK;
}

function hex64(v) {
  return '0x' + v.toString(16).padStart(16, '0');
}

function emit(obj) {
  process.stdout.write(JSON.stringify(obj) + '\n');
}

function args(argv) {
  const out = { versions: 1, receiverId: '', addresses: [], leave: false };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i];
    const value = argv[i + 1];
    if (key === '--leave') {
      out.leave = true;
      continue;
    }
    if (key === '--proto') out.proto = value;
    else if (key === '--address') out.addresses.push(value); // one per sender (§4.1)
    else if (key === '--receiver-id') out.receiverId = value;
    else if (key === '--versions') out.versions = Number(value);
    else throw new Error(`unknown argument ${key}`);
    i++;
  }
  return out;
}

/** Staging buffers by buffer_id: Node has no mmap, so each bucket is read with pread. */
class ShmFiles {
  constructor() {
    this.fds = new Map();
  }
  read(handle, nbytes) {
    if (handle.kind !== 'shm') throw new Error(`buffer ${handle.buffer_id} is not shm`);
    let fd = this.fds.get(handle.buffer_id);
    if (fd === undefined) {
      fd = fs.openSync(handle.shm.path, 'r');
      this.fds.set(handle.buffer_id, fd);
    }
    const buf = Buffer.alloc(nbytes);
    let got = 0;
    while (got < nbytes) {
      const n = fs.readSync(fd, buf, got, nbytes - got, got);
      if (n === 0) throw new Error(`${handle.shm.path} ends at byte ${got} of ${nbytes}`);
      got += n;
    }
    return buf;
  }
  close() {
    for (const fd of this.fds.values()) fs.closeSync(fd);
    this.fds.clear();
  }
}

/**
 * The keeping side of one kind on one stream (§2.1 rule 4): contents received under a new key
 * while 16 are kept forget them all first. Keys are bytes (Buffers), held as hex.
 */
class KeptByKey {
  constructor() {
    this.known = new Map();
  }
  keep(key, value) {
    const k = key.toString('hex');
    if (!this.known.has(k) && this.known.size >= KEYS_KEPT) this.known.clear();
    this.known.set(k, value);
  }
  get(key) {
    return this.known.get(key.toString('hex'));
  }
}

/**
 * `start`'s manifest: kept under its key, or the one `kept` holds for a start sent by key
 * alone (no tensors: a manifest is never empty); null for a key the stream holds nothing under.
 */
function manifestOf(start, kept) {
  const m = start.manifest;
  if (start.manifest_key.length === 0) return m;
  if (m.tensors.length > 0) {
    kept.keep(start.manifest_key, m);
    return m;
  }
  const known = kept.get(start.manifest_key);
  return known === undefined ? null : { ...known, version: m.version };
}

function planError(message) {
  return { code: 'PlanError', message };
}

/**
 * Applies versions from one sender, or versions split over several (Manifest.part, §4.1):
 * `senders[i]` is {address, call}. Versions are uint64: compared as BigInt.
 */
class Receiver {
  constructor(senders, onFinished) {
    this.senders = senders;
    this.onFinished = onFinished;
    this.files = new ShmFiles();
    this.collecting = null; // BigInt: the version whose starts are being collected
    this.starts = new Map(); // sender -> its manifest of that version
    // sender -> its buckets and end of the version being collected, unread and unacked until
    // every part started and the verdict accepts it (§4.1)
    this.held = new Map();
    this.current = null;
    this.byKey = new Set(); // versions whose manifest came by key alone (§2.1)
  }

  send(i, msg) {
    this.senders[i].call.write(msg);
  }

  describe(i, m) {
    const address = this.senders[i].address;
    if (!m.part) return `the whole version from the sender at ${address}`;
    return `part ${m.part.index} of ${m.part.count} from sender ${m.part.sender_id} at ${address}`;
  }

  refuse(i, version, error) {
    this.send(i, { verdict: { version, accepted: false, error } });
  }

  onStart(i, start) {
    const m = manifestOf(start, this.senders[i].manifests);
    if (m === null) {
      const key = start.manifest_key.toString('hex');
      const message = `version ${start.manifest.version}: a start came by manifest_key ${key} alone, but this stream holds nothing under that key`;
      const error = { code: 'ProtocolError', message };
      this.refuse(i, start.manifest.version, error);
      emit({ event: 'rejected', version: Number(start.manifest.version), error });
      this.onFinished();
      return;
    }
    if (m !== start.manifest) this.byKey.add(String(m.version));
    const v = BigInt(m.version);
    if (this.current !== null) {
      const message = `version ${v} started while version ${this.current.version} is still applied`;
      this.refuse(i, m.version, { code: 'ProtocolError', message });
      return;
    }
    if (this.senders.length === 1) {
      const error = m.part
        ? planError(`version ${v} is ${this.describe(i, m)}, but this receiver is registered with one sender; register it with every sender`)
        : null;
      this.answer(m.version, new Map([[i, m]]), error);
      return;
    }
    if (this.collecting === null || v > this.collecting) {
      for (const [j, old] of this.starts) {
        this.refuse(j, old.version, planError(`version ${old.version} is superseded by version ${v}`));
      }
      this.collecting = v;
      this.starts = new Map();
      this.held = new Map();
    } else if (v < this.collecting) {
      this.refuse(i, m.version, planError(`version ${v} is older than version ${this.collecting}, being collected`));
      return;
    }
    if (this.starts.has(i)) {
      this.refuse(i, m.version, planError(`version ${v}: a second start from one sender`));
      return;
    }
    this.starts.set(i, m);
    if (this.starts.size === this.senders.length) {
      const starts = this.starts;
      const held = this.held;
      this.collecting = null;
      this.starts = new Map();
      this.held = new Map();
      if (this.answer(m.version, starts, this.checkParts(v, starts))) {
        for (const i of [...held.keys()].sort((x, y) => x - y)) {
          for (const [kind, msg] of held.get(i)) { // now read what came early, in order
            if (kind === 'bucket') this.onBucket(i, msg);
            else this.onEnd(i, msg);
          }
        }
      }
    }
  }

  /** docs/protocol.md §4.1 step 2, before any write. */
  checkParts(v, starts) {
    const order = [...starts.keys()].sort((a, b) => a - b);
    const first = starts.get(order[0]);
    const firstName = this.describe(order[0], first);
    for (const i of order) {
      if (!starts.get(i).part) {
        return planError(`version ${v}: ${this.describe(i, starts.get(i))} came beside ${firstName}; a version is whole or split over every sender`);
      }
    }
    const want = first.part;
    if (want.count !== this.senders.length) {
      return planError(`version ${v} is split over ${want.count} senders (${firstName}) but this receiver is registered with ${this.senders.length}`);
    }
    const loraOf = (m) => (m.lora ? JSON.stringify([m.lora.name, m.lora.config_json, m.lora.tensor_names]) : '');
    const indices = new Set();
    for (const i of order) {
      const m = starts.get(i);
      const p = m.part;
      if (p.plan_digest !== want.plan_digest || p.count !== want.count || p.num_tensors !== want.num_tensors) {
        return planError(`version ${v}: ${this.describe(i, m)} announces plan ${p.plan_digest}, ${p.count} parts, ${p.num_tensors} tensors; ${firstName} announces ${want.plan_digest}, ${want.count}, ${want.num_tensors}`);
      }
      if (loraOf(m) !== loraOf(first)) return planError(`version ${v}: the parts announce different LoRA adapters`);
      if (indices.has(p.index) || p.index >= p.count) {
        return planError(`version ${v}: ${this.describe(i, m)}: index taken or past count`);
      }
      indices.add(p.index);
    }
    const owner = new Map();
    for (const i of order) {
      const m = starts.get(i);
      for (const t of m.tensors) {
        if (owner.has(t.name)) {
          const j = owner.get(t.name);
          return planError(`version ${v}: tensor '${t.name}' is in ${this.describe(j, starts.get(j))} and in ${this.describe(i, m)}`);
        }
        owner.set(t.name, i);
      }
    }
    if (owner.size !== want.num_tensors) {
      return planError(`version ${v}: the parts carry ${owner.size} tensors, num_tensors says ${want.num_tensors}`);
    }
    return null;
  }

  /** One verdict to every sender of the version: accepted on all or rejected on all; whether accepted. */
  answer(version, starts, error) {
    const cur = {
      version, specs: {}, data: {}, filled: {}, sums: new Map(), ends: new Map(), aborted: new Map(),
    };
    for (const i of [...starts.keys()].sort((a, b) => a - b)) {
      for (const t of starts.get(i).tensors) {
        const shape = t.shape.map(Number);
        if (error === null && ITEMSIZE[t.dtype] === undefined) {
          error = { code: 'ManifestMismatchError', message: `unknown dtype of '${t.name}'`, tensor: t.name };
        }
        const n = shape.reduce((a, b) => a * b, 1) * (ITEMSIZE[t.dtype] || 0);
        cur.specs[t.name] = { dtype: t.dtype, shape };
        cur.data[t.name] = Buffer.alloc(n);
        cur.filled[t.name] = 0;
      }
    }
    for (const i of starts.keys()) {
      const verdict = { version, accepted: error === null };
      if (error !== null) verdict.error = error;
      this.send(i, { verdict });
    }
    if (error !== null) {
      emit({ event: 'rejected', version: Number(version), error });
      this.onFinished();
      return false;
    }
    this.current = cur;
    return true;
  }

  /** Keep a bucket or end of a part whose version is still being collected. */
  hold(i, version, kind, msg) {
    if (this.current === null && this.collecting !== null && BigInt(version) === this.collecting && this.starts.has(i)) {
      if (!this.held.has(i)) this.held.set(i, []);
      this.held.get(i).push([kind, msg]);
      return true;
    }
    return false;
  }

  onBucket(i, b) {
    if (this.hold(i, b.version, 'bucket', b)) return;
    const cur = this.current;
    if (cur === null || b.version !== cur.version || cur.aborted.has(i)) return;
    if (b.sources.length || b.group_id || !b.buffer || b.buffer.kind !== 'shm') {
      throw new Error(`bucket ${b.layout.index}: only shm staging is implemented`);
    }
    const nbytes = Number(b.layout.nbytes);
    const data = this.files.read(b.buffer, nbytes); // read before the ack: the slot is reused
    cur.sums.set(`${i}/${b.layout.index}`, { sender: i, index: b.layout.index, sum: checksum(data, nbytes) });
    for (const e of b.layout.entries) {
      const off = Number(e.offset);
      const len = Number(e.nbytes);
      data.copy(cur.data[e.tensor.name], Number(e.tensor_offset), off, off + len);
      cur.filled[e.tensor.name] += len;
    }
    this.send(i, { ack: { version: b.version, index: b.layout.index, ok: true } });
  }

  onEnd(i, end) {
    if (this.hold(i, end.version, 'end', end)) return;
    if (this.current === null || end.version !== this.current.version) return;
    this.current.ends.set(i, end);
    this.finish();
  }

  onAbort(i, abort) {
    emit({ event: 'aborted', version: Number(abort.version), sender: i, reason: abort.reason });
    const cur = this.current;
    if (cur !== null && abort.version === cur.version) {
      cur.aborted.set(i, abort.reason);
      this.finish();
    } else if (this.collecting !== null && BigInt(abort.version) === this.collecting) {
      // A part that will never come: refuse the version on the senders that started it.
      for (const [j, m] of this.starts) {
        if (j !== i) this.refuse(j, m.version, planError(`version ${abort.version}: part from sender ${i} was aborted`));
      }
      this.collecting = null;
      this.starts = new Map();
      this.held = new Map();
    }
  }

  /**
   * Once every sender ended its part (end or abort): commit only if every part arrived with
   * every checksum matching; tell every sender that did not abort.
   */
  finish() {
    const cur = this.current;
    if (cur.ends.size + cur.aborted.size < this.senders.length) return;
    let error = null;
    let code = 'ChecksumError';
    if (cur.aborted.size) {
      const [i, reason] = [...cur.aborted.entries()].sort((a, b) => a[0] - b[0])[0];
      code = (reason && reason.code) || 'WeightSyncError';
      error = `the part from ${this.senders[i].address} was aborted: ${reason ? reason.message : ''}`;
    }
    for (const end of cur.ends.values()) {
      if (error === null && end.checksum_algorithm !== CHECKSUM_ALGORITHM) {
        error = `unknown checksum algorithm ${end.checksum_algorithm}`;
      }
    }
    const sums = [...cur.sums.values()].sort((a, b) => a.sender - b.sender || a.index - b.index);
    for (const { sender, index, sum } of sums) {
      const end = cur.ends.get(sender);
      const want = end && index < end.checksums.length ? BigInt(end.checksums[index]) : null;
      if (error === null && sum !== want) {
        error = `sender ${sender} bucket ${index}: checksum ${hex64(sum)}, sender says ${want}`;
      }
    }
    for (const [name, buf] of Object.entries(cur.data)) {
      if (error === null && cur.filled[name] !== buf.length) {
        code = 'ProtocolError';
        error = `${name} is incomplete`;
      }
    }
    for (const i of cur.ends.keys()) {
      const applied = { version: cur.version, ok: error === null };
      if (error !== null) applied.error = { code, message: error };
      this.send(i, { applied });
    }
    const tensors = {};
    for (const [name, spec] of Object.entries(cur.specs)) {
      tensors[name] = { ...spec, hex: cur.data[name].toString('hex') };
    }
    const checksums = {};
    for (const { sender, index, sum } of sums) checksums[`${sender}/${index}`] = hex64(sum);
    emit({
      event: error === null ? 'applied' : 'failed',
      version: Number(cur.version),
      manifest_by_key: this.byKey.has(String(cur.version)),
      error,
      buckets: sums.length,
      checksums,
      tensors,
    });
    this.current = null;
    this.onFinished();
  }
}

function receive(opts) {
  const grpc = require('@grpc/grpc-js');
  const protoLoader = require('@grpc/proto-loader');
  const definition = protoLoader.loadSync(opts.proto, {
    keepCase: true, // field names as in the .proto
    longs: String, // uint64 / fixed64 as decimal strings (exact)
    enums: String,
    defaults: true,
    oneofs: true, // `kind` names the oneof member that is set
  });
  const v1 = grpc.loadPackageDefinition(definition).weightsync.v1;
  // The sender's token, when it requires one, goes with every call (docs/protocol.md).
  const metadata = new grpc.Metadata();
  if (process.env.WEIGHTSYNC_TOKEN) metadata.add('authorization', `Bearer ${process.env.WEIGHTSYNC_TOKEN}`);
  if (opts.addresses.length === 0) throw new Error('--address is required');

  let finished = 0;
  let leaving = false;
  const welcomed = new Map(); // sender -> receiver_id it gave
  const statuses = new Map(); // sender -> {code, details} it ended the stream with
  const senders = opts.addresses.map((address) => {
    const client = new v1.WeightSync(address, grpc.credentials.createInsecure());
    return { address, client, call: client.Receive(metadata), manifests: new KeptByKey() };
  });

  const leave = () => {
    // The orderly leave (§4): half-close every stream; each sender handles what came before,
    // then ends its stream with status OK.
    if (leaving) return;
    leaving = true;
    for (const s of senders) s.call.end();
  };
  const rx = new Receiver(senders, () => {
    finished += 1;
    if (finished === opts.versions) {
      if (opts.leave || process.stdin.readableEnded) leave();
      else process.stdin.on('end', leave);
    }
  });

  senders.forEach((s, i) => {
    s.call.write({
      hello: {
        receiver_id: opts.receiverId,
        engine: 'conformance-node',
        rank: 0,
        device: 'cpu',
        transports: ['shm'],
        host_id: '', // empty: same host as the sender, map its buffers
        manifest_keys: true, // §2.1
      },
    });
    s.call.on('data', (msg) => {
      if (finished >= opts.versions && msg.kind !== 'welcome') return; // done: only leaving
      switch (msg.kind) {
        case 'welcome':
          welcomed.set(i, msg.welcome.receiver_id);
          if (welcomed.size === senders.length) {
            const ids = new Set(welcomed.values());
            if (ids.size !== 1) throw new Error(`the senders registered this receiver as ${[...ids]}`);
            emit({ event: 'registered', receiver_id: msg.welcome.receiver_id });
          }
          break;
        case 'start':
          rx.onStart(i, msg.start);
          break;
        case 'bucket':
          rx.onBucket(i, msg.bucket);
          break;
        case 'end':
          rx.onEnd(i, msg.end);
          break;
        case 'abort':
          rx.onAbort(i, msg.abort);
          break;
        case 'join':
          throw new Error('broadcast joins are not implemented by this client');
        default:
          break;
      }
    });
    s.call.on('error', (err) => {
      if (!leaving) {
        process.stderr.write(`stream to ${s.address} failed: ${err.code} ${err.details}\n`);
        process.exitCode = 1;
      }
    });
    s.call.on('status', (status) => {
      statuses.set(i, { code: grpc.status[status.code], details: status.details });
      if (statuses.size === senders.length) {
        rx.files.close();
        for (const t of senders) t.client.close();
        const ordered = senders.map((_, j) => statuses.get(j));
        emit({ event: 'closed', receiver_id: welcomed.get(0) || '', statuses: ordered });
        process.stdin.pause();
      }
    });
  });
  process.stdin.resume(); // the test closes stdin once it has checked Status
}

function main() {
  const [cmd, ...rest] = process.argv.slice(2);
  if (cmd === 'checksum') {
    const data = Buffer.from(fs.readFileSync(0, 'utf8').trim(), 'hex');
    emit({ event: 'checksum', nbytes: data.length, value: hex64(checksum(data, data.length)) });
  } else if (cmd === 'receive') {
    receive(args(rest));
  } else {
    process.stderr.write('usage: client.js checksum < HEX | receive --proto P --address A\n');
    process.exitCode = 2;
  }
}

main();
