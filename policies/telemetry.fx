// Observation only: counters per movement, per-port utilisation histograms,
// and a ring of large transfers.  Makes no decisions, so it changes nothing
// about the run; it shows what flows where.
import "fabrics/dgx_cxl.fx"

workload prefill { model: "llama3-8b"; prompt: 8192; tp: 4; weights: pool0; kv: pool0 }

movement weights_in = weights(ffn) : pool0 -> gpu* { critical }
movement kv_out     = kv : gpu* -> pool0

map bytes_by_movement : hash<u32, size>[64]
map chunks_by_movement : hash<u32, count>[64]
map util_hist : array<u32, count>[11]          // buckets of 10%
map big_chunks : ringbuf[64KiB]

policy telemetry {
  on weights_in.forward {
    bytes_by_movement[ev.movement] += ev.bytes
    chunks_by_movement[ev.movement] += 1
  }
  on kv_out.forward {
    bytes_by_movement[ev.movement] += ev.bytes
    chunks_by_movement[ev.movement] += 1
    if ev.bytes >= 4MiB { emit big_chunks(now, ev.movement, ev.bytes) }
  }
  on sw0.tick(10us) { util_hist[min(ev.util_pct / 10, 10)] += 1 }
}
