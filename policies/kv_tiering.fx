// Switch-local memory tiering of KV cache: hot layers' KV stays in the pool
// behind the switch, while KV of layers written often is counted so that
// later accesses can be promoted; big writebacks are deferred when the
// switch port is busy.
import "fabrics/dgx_cxl.fx"

workload prefill { model: "llama3-8b"; prompt: 8192; tp: 4; weights: hbm; kv: pool0; chunk: 1MiB }

movement kv_writeback = kv : gpu* -> pool0
movement kv_reload    = kv : pool0 -> gpu*

map layer_writes : array<u32, count>[128]   // writes per layer
map port_util    : array<u32, percent>[16]

policy kv_tiering {
  on sw0.tick(20us) { port_util[ev.port] = ev.util_pct }

  on kv_writeback.mem_access at sw0 {
    layer_writes[ev.layer] += 1
    // layers written more than 4 times are hot: keep them in the pool
    if layer_writes[ev.layer] > 4 { tier = pool0 }
  }

  on kv_writeback.forward at sw0 when ev.bytes >= 512KiB {
    if port_util[ev.out_port] > 70% { defer = 5us }
  }

  on kv_reload.forward { priority = 6 }
}
