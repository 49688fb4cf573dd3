// A weightsync receiver in Node, written from docs/protocol.md and the .proto alone
// (@grpc/grpc-js, @grpc/proto-loader; no generated code, no weightsync import).
//
//   node client.js checksum < HEX
//       the bucket checksum (ws-rows64k-v3) of the bytes written in hex on stdin
//   node client.js receive --proto PATH --address unix:/path [--receiver-id ID] [--versions N]
//       register, apply N versions from shm staging buffers (checksums verified), print one JSON
//       line per version with every tensor's bytes, then leave when stdin closes
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
  const out = { versions: 1, receiverId: '' };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i];
    const value = argv[i + 1];
    if (key === '--proto') out.proto = value;
    else if (key === '--address') out.address = value;
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
  const client = new v1.WeightSync(opts.address, grpc.credentials.createInsecure());
  // The sender's token, when it requires one, goes with the call (docs/protocol.md).
  const metadata = new grpc.Metadata();
  if (process.env.WEIGHTSYNC_TOKEN) metadata.add('authorization', `Bearer ${process.env.WEIGHTSYNC_TOKEN}`);
  const call = client.Receive(metadata);
  const files = new ShmFiles();
  let current = null;
  let applied = 0;
  let receiverId = '';
  let leaving = false;

  call.write({
    hello: {
      receiver_id: opts.receiverId,
      engine: 'conformance-node',
      rank: 0,
      device: 'cpu',
      transports: ['shm'],
      host_id: '', // empty: same host as the sender, map its buffers
    },
  });

  const leave = () => {
    // Half-close: the sender ends the stream and marks this receiver disconnected.
    leaving = true;
    call.end();
  };

  call.on('data', (msg) => {
    switch (msg.kind) {
      case 'welcome':
        receiverId = msg.welcome.receiver_id;
        emit({ event: 'registered', receiver_id: receiverId });
        break;
      case 'start': {
        const m = msg.start.manifest;
        current = { version: m.version, specs: {}, data: {}, filled: {}, sums: new Map() };
        for (const t of m.tensors) {
          const shape = t.shape.map(Number);
          const n = shape.reduce((a, b) => a * b, 1) * ITEMSIZE[t.dtype];
          current.specs[t.name] = { dtype: t.dtype, shape };
          current.data[t.name] = Buffer.alloc(n);
          current.filled[t.name] = 0;
        }
        call.write({ verdict: { version: m.version, accepted: true } });
        break;
      }
      case 'bucket': {
        const b = msg.bucket;
        if (current === null || b.version !== current.version) break;
        if (b.sources.length || b.group_id || !b.buffer || b.buffer.kind !== 'shm') {
          throw new Error(`bucket ${b.layout.index}: only shm staging is implemented`);
        }
        const nbytes = Number(b.layout.nbytes);
        const data = files.read(b.buffer, nbytes); // read before the ack: the slot is reused
        current.sums.set(b.layout.index, checksum(data, nbytes));
        for (const e of b.layout.entries) {
          const off = Number(e.offset);
          const len = Number(e.nbytes);
          data.copy(current.data[e.tensor.name], Number(e.tensor_offset), off, off + len);
          current.filled[e.tensor.name] += len;
        }
        call.write({ ack: { version: b.version, index: b.layout.index, ok: true } });
        break;
      }
      case 'end': {
        const end = msg.end;
        if (current === null || end.version !== current.version) break;
        let error = null;
        if (end.checksum_algorithm !== CHECKSUM_ALGORITHM) {
          error = `unknown checksum algorithm ${end.checksum_algorithm}`;
        }
        for (const [index, got] of [...current.sums.entries()].sort((a, b) => a[0] - b[0])) {
          const want = index < end.checksums.length ? BigInt(end.checksums[index]) : null;
          if (error === null && got !== want) {
            error = `bucket ${index}: checksum ${hex64(got)}, sender says ${want}`;
          }
        }
        for (const [name, buf] of Object.entries(current.data)) {
          if (error === null && current.filled[name] !== buf.length) error = `${name} is incomplete`;
        }
        const appliedMsg = { version: current.version, ok: error === null };
        if (error !== null) appliedMsg.error = { code: 'ChecksumError', message: error };
        call.write({ applied: appliedMsg });
        const tensors = {};
        for (const [name, spec] of Object.entries(current.specs)) {
          tensors[name] = { ...spec, hex: current.data[name].toString('hex') };
        }
        const checksums = {};
        for (const [index, v] of current.sums) checksums[index] = hex64(v);
        emit({
          event: error === null ? 'applied' : 'failed',
          version: Number(current.version),
          error,
          buckets: current.sums.size,
          checksums,
          tensors,
        });
        current = null;
        applied += 1;
        if (applied >= opts.versions) {
          if (process.stdin.readableEnded) leave();
          else process.stdin.on('end', leave);
        }
        break;
      }
      case 'abort':
        emit({ event: 'aborted', version: Number(msg.abort.version), reason: msg.abort.reason });
        current = null;
        break;
      case 'join':
        throw new Error('broadcast joins are not implemented by this client');
      default:
        break;
    }
  });
  call.on('error', (err) => {
    if (!leaving) {
      process.stderr.write(`stream failed: ${err.code} ${err.details}\n`);
      process.exitCode = 1;
    }
  });
  call.on('end', () => {
    files.close();
    client.close();
    emit({ event: 'closed', receiver_id: receiverId });
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
