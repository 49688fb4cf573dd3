"""``weightsync sender`` and ``weightsync-sender``: the sender daemon's options and entry point
(wired in from :mod:`weightsync.app.cli`)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from weightsync import __version__
from weightsync.app import arguments
from weightsync.config import DEFAULT_ADDRESS

MIB = 1024 * 1024
log = logging.getLogger("weightsync.sender")


def add_sender_args(p: argparse.ArgumentParser) -> None:
    """Define the sender's options (each also read from a WEIGHTSYNC_* variable) on ``p``."""
    p.add_argument(
        "--listen",
        type=arguments.address,
        default=None,
        help=f"unix:/path or host:port (default: $WEIGHTSYNC_LISTEN or {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--bucket-size-mb",
        type=arguments.mib,
        default=None,
        help="staging bucket cap in MiB, a positive integer (default 512; "
        "WEIGHTSYNC_BUCKET_SIZE_BYTES in bytes); tensors larger are chunked",
    )
    p.add_argument(
        "--num-buffers",
        type=arguments.buffers,
        default=None,
        help="staging buffers, >= 2 (default 2; WEIGHTSYNC_NUM_BUFFERS): packing bucket i+1 "
        "overlaps loading bucket i",
    )
    p.add_argument(
        "--transport",
        choices=["auto", "shm", "cuda_ipc", "nccl"],
        default=None,
        help="auto: receivers on this host map the staging buffers (cuda_ipc for CUDA "
        "tensors, shm for CPU ones), others get broadcasts; nccl: broadcast to every receiver "
        "(default auto; WEIGHTSYNC_TRANSPORT)",
    )
    p.add_argument(
        "--broadcast-host",
        default=None,
        help="address remote receivers reach the broadcast rendezvous at (default 127.0.0.1; "
        "WEIGHTSYNC_BROADCAST_HOST)",
    )
    p.add_argument(
        "--ack-timeout-s",
        type=arguments.seconds,
        default=None,
        help="fail a receiver that owes a reply this long (default 120; WEIGHTSYNC_ACK_TIMEOUT_S)",
    )
    p.add_argument(
        "--max-streams",
        type=arguments.streams,
        default=None,
        help="open Publish/Receive streams served at once (publisher ranks plus receivers; "
        "each holds a thread); past it a new one is refused, saying so (default 1024; "
        "WEIGHTSYNC_MAX_STREAMS)",
    )
    p.add_argument(
        "--hello-timeout-s",
        type=arguments.seconds,
        default=None,
        help="close a stream that sends no hello this long after opening, freeing its slot "
        "(default 10; WEIGHTSYNC_HELLO_TIMEOUT_S)",
    )
    p.add_argument(
        "--retain-mb",
        type=arguments.megabytes,
        default=None,
        help="keep the last version applied in host memory (when its staged bytes fit in "
        "this many MiB) so a receiver that registers behind it catches up even when no "
        "engine holds it; engines that applied it are the sources first (default 0: retain "
        "nothing; WEIGHTSYNC_RETAIN_BYTES)",
    )
    p.add_argument(
        "--delta-mb",
        type=arguments.megabytes,
        default=None,
        help="keep each broadcast bucket's last bytes (up to this many MiB in all, on the "
        "staging device) and send the next version's as an exact delta to groups whose "
        "receivers hold them (default 0: off; WEIGHTSYNC_DELTA_BYTES)",
    )
    p.add_argument(
        "--metrics-port",
        type=arguments.port,
        default=None,
        help="serve Prometheus metrics on this port (default 0: off; WEIGHTSYNC_METRICS_PORT)",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        help="address the metrics endpoint binds to (default 127.0.0.1, this machine only; "
        "0.0.0.0 for every interface; WEIGHTSYNC_METRICS_HOST)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="a file holding the shared token every client must send (WEIGHTSYNC_TOKEN_FILE; "
        "or the token itself in WEIGHTSYNC_TOKEN, never on the command line)",
    )
    p.add_argument(
        "--tls-cert",
        default=None,
        help="PEM certificate chain: serve TLS, with --tls-key (WEIGHTSYNC_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key", default=None, help="PEM private key of --tls-cert (WEIGHTSYNC_TLS_KEY)"
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA bundle: every client must present a certificate it signed (mutual TLS; "
        "WEIGHTSYNC_TLS_CA)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="listen on TCP with neither token nor TLS: anyone who reaches the port may publish "
        "and receive (a trusted network only; WEIGHTSYNC_INSECURE=1)",
    )
    p.add_argument(
        "--socket-group",
        default=None,
        help="a unix socket's group, which may then connect (0660; default: owner only, 0600; "
        "WEIGHTSYNC_SOCKET_GROUP)",
    )
    p.add_argument(
        "--no-lanes",
        dest="lanes",
        action="store_false",
        default=None,
        help="keep every stream on gRPC; by default clients on this machine move their "
        "stream's messages to a Unix-socket lane, which skips gRPC's thread handoffs "
        "(about 0.2-0.8 ms a message; WEIGHTSYNC_LANES=0)",
    )
    p.add_argument(
        "--no-armed-starts",
        dest="armed_starts",
        action="store_false",
        default=None,
        help="plan every version before announcing it; by default a direct version whose plan "
        "repeats the last one's goes to its receivers first, and is planned while they copy "
        "(0.2-0.5 ms a version on the H200 hosts measured; WEIGHTSYNC_ARMED_STARTS=0)",
    )
    arguments.add_log_args(p)


def _sender_settings(args: argparse.Namespace) -> dict:
    given = {
        "listen": args.listen,
        "bucket_size_bytes": args.bucket_size_mb * MIB if args.bucket_size_mb else None,
        "num_buffers": args.num_buffers,
        "transport": args.transport,
        "ack_timeout_s": args.ack_timeout_s,
        "max_streams": args.max_streams,
        "hello_timeout_s": args.hello_timeout_s,
        "retain_bytes": None if args.retain_mb is None else args.retain_mb * MIB,
        "delta_bytes": None if args.delta_mb is None else args.delta_mb * MIB,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "broadcast_host": args.broadcast_host,
        "token_file": args.token_file,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_ca": args.tls_ca,
        "insecure": args.insecure,
        "socket_group": args.socket_group,
        "lanes": args.lanes,
        "armed_starts": args.armed_starts,
    }
    return {k: v for k, v in given.items() if v is not None}


def run_sender(args: argparse.Namespace) -> int:
    from weightsync.gc_pause import freeze_startup
    from weightsync.sender import Sender

    stop = threading.Event()
    # Before the sender binds its socket: a signal after that but before a handler would end
    # the process with the socket file left behind.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sender = Sender(**_sender_settings(args))
    s = sender.settings
    metrics = sender.metrics.address
    log.info(
        "weightsync-sender %s listening on %s (%s; transport %s, %d x %d MiB buckets%s); "
        "Ctrl-C stops",
        __version__,
        sender.address,
        sender.protection,
        s.transport,
        s.num_buffers,
        s.bucket_size_bytes // MIB,
        f", metrics on http://{metrics[0]}:{metrics[1]}/metrics" if metrics else "",
    )
    # After the line above: clients may connect once it serves, and their lines must not come
    # before it (freezing walks every object, a while on a loaded machine).
    log.debug("froze %d startup objects out of the garbage collector's walks", freeze_startup())
    sender.wait(stop)
    return 0
