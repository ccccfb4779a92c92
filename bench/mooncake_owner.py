"""A process that owns Mooncake Store memory: it mounts one segment of the
given size and serves it until its standard input closes (the runner that
started it stopped it, or died). The data-plane layout: store memory in a
process other than the benchmark's clients.

    python bench/mooncake_owner.py MASTER_ADDR SEGMENT_BYTES [SSD_OFFLOAD_DIR]
"""

import sys

from mooncake.store import MooncakeDistributedStore


def main() -> int:
    master, segment = sys.argv[1], int(sys.argv[2])
    store = MooncakeDistributedStore()
    cfg = {
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": str(segment), "local_buffer_size": str(16 << 20),
        "protocol": "tcp", "master_server_addr": master,
    }
    if len(sys.argv) > 3:  # the disk workload: Mooncake's SSD offload
        cfg.update({"enable_ssd_offload": "true", "ssd_offload_path": sys.argv[3]})
    rc = store.setup(cfg)
    if rc != 0:
        print(f"FAILED setup {rc}", flush=True)
        return 1
    print("READY", flush=True)
    sys.stdin.buffer.read()  # blocks until the runner closes our stdin
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
