;; Blocks inside a WASI host call: poll_oneoff on a 60 s monotonic clock. Epoch interruption only
;; fires in wasm code, so only the tool runner's worker deadline can stop this one.
(module
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    ;; subscription at 0: userdata u64 @0, tag u8 @8 (0 = clock), clock id u32 @16 (1 = monotonic),
    ;; timeout u64 @24 (ns, relative), precision u64 @32, flags u16 @40
    (i32.store (i32.const 16) (i32.const 1))
    (i64.store (i32.const 24) (i64.const 60000000000))
    (drop (call $poll (i32.const 0) (i32.const 64) (i32.const 1) (i32.const 128)))))
