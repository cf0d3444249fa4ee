// The LLM prefill stress case.  Weights stream from the CXL pool each layer,
// KV is written back to the pool and exported through the DPU, and the GPUs
// all-reduce over NVLink after attention and FFN.  The policy puts the
// weights that gate the next kernel first at every switch they cross, and
// keeps background KV traffic from crowding them out.
import "fabrics/dgx_cxl.fx"

workload prefill {
  model: "llama3-8b"; prompt: 8192; batch: 1; tp: 8
  weights: pool0; kv: pool0; kv_export: nic0; chunk: 2MiB
}

movement attn_weights = weights(attention) : pool0 -> gpu* { critical }
movement ffn_weights  = weights(ffn)       : pool0 -> gpu* { critical }
movement kv_writeback = kv                 : gpu*  -> pool0
movement kv_export    = kv                 : gpu*  -> nic0
movement allreduce    = activations(collective) : gpu* <-> gpu*

map port_util : array<u32, percent>[16]     // switch port utilisation, written by tick
map kv_bytes  : hash<device, size>[8]       // KV bytes each GPU has written back

policy prefill_qos {
  on sw0.tick(10us) { port_util[ev.port] = ev.util_pct }

  // weights gate the next kernel: first at every switch on their path
  on attn_weights.forward { priority = 7 }
  on ffn_weights.forward  { priority = 7 }

  // KV writeback is background: lowest class, and paced when the port is hot
  on kv_writeback.forward at sw0 {
    priority = 1
    if port_util[ev.out_port] > 80% { rate = 16GB/s }
  }
  on kv_writeback.issue at gpu* { kv_bytes[ev.src] += ev.bytes }

  // pull the next layers' weights early on every GPU
  on ffn_weights.issue at gpu*  { prefetch = 2 }
  on attn_weights.issue at gpu* { prefetch = 2 }

  // KV export: pace it at the DPU so it does not burst into the switch
  on kv_export.forward at sw0 { priority = 2 }
  on kv_export.tx at nic0 { rate = 25GB/s }
}
