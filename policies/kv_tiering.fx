// Tiering of KV cache in a chunked prefill: each pass writes its layers' KV to
// the CXL pool behind the switch, and the later passes read it back.  While the
// pool's channel is busy, a chunk spills to host memory instead (and is read
// back from there); big writebacks wait while the switch port is busy, and what
// is read back goes first at the switch.
import "fabrics/dgx_cxl.fx"

workload prefill { model: "llama3-8b"; prompt: 8192; prefill_chunk: 2048; tp: 4; weights: hbm; kv: pool0; chunk: 1MiB }

movement kv_writeback = kv : gpu* -> pool0
movement kv_reload    = kv : pool0 -> gpu*
movement kv_spilled   = kv : cpu0 -> gpu*   // read back from host memory

map layer_writes : array<u32, count>[128]   // KV chunks written back per layer
map port_util    : array<u32, percent>[16]

policy kv_tiering {
  on sw0.tick(20us) { port_util[ev.port] = ev.util_pct }

  on kv_writeback.mem_access at sw0 {
    layer_writes[ev.layer] += 1
    // the pool's channel is busy: this chunk goes to host memory
    if port_util[ev.out_port] > 50% { tier = cpu0 }
  }

  on kv_writeback.forward at sw0 when ev.bytes >= 512KiB {
    if port_util[ev.out_port] > 70% { defer = 5us }
  }

  on kv_reload.forward { priority = 6 }
  on kv_spilled.forward { priority = 6 }
}
