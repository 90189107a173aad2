;; tries to create and write /data/out.txt through the first pre-open (fd 3); exit 1 if refused
(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "out.txt")
  (data (i32.const 200) "written by a tool\n")
  (func (export "_start")
    ;; oflags: creat (1) | trunc (8); rights: fd_write (bit 6)
    (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 100) (i32.const 7) (i32.const 9)
                         (i64.const 64) (i64.const 0) (i32.const 0) (i32.const 0))
      (then (call $proc_exit (i32.const 1))))
    (i32.store (i32.const 16) (i32.const 200))
    (i32.store (i32.const 20) (i32.const 18))
    (drop (call $fd_write (i32.load (i32.const 0)) (i32.const 16) (i32.const 1) (i32.const 24)))
    (call $proc_exit (i32.const 0))))
