;; file.read@1.2.0: print the file named by argv[1] (relative to the first pre-opened directory).
;; Built for WASI preview 1. Every access goes through fd 3, the only directory the host pre-opens,
;; so an absolute path, a "..", or a directory the contract did not declare is refused by WASI
;; itself, not by this code. Exit 0 with the contents on stdout, or 1 with the error on stderr.
(module
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $args_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 3)
  ;; 0: argc   4: argv buf size   16: argv pointers   64: iovec   80: count   96: opened fd
  ;; 128: messages   1024: argv buffer (<= 60 KiB)   65536: read buffer (128 KiB)
  (data (i32.const 128) "file.read: usage: file.read PATH\n")          ;; 33 bytes
  (data (i32.const 192) "file.read: cannot open the path (WASI errno ") ;; 44 bytes
  (data (i32.const 256) ")\n")
  (data (i32.const 272) "file.read: read failed\n")                    ;; 23 bytes

  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 64) (local.get $ptr))
    (i32.store (i32.const 68) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 64) (i32.const 1) (i32.const 80))))

  (func $strlen (param $p i32) (result i32) (local $n i32)
    (block $done
      (loop $next
        (br_if $done (i32.eqz (i32.load8_u (i32.add (local.get $p) (local.get $n)))))
        (local.set $n (i32.add (local.get $n) (i32.const 1)))
        (br $next)))
    (local.get $n))

  ;; the errno in decimal (at most 3 digits) at 300, returns its length
  (func $itoa (param $v i32) (result i32)
    (if (i32.ge_u (local.get $v) (i32.const 100))
      (then
        (i32.store8 (i32.const 300) (i32.add (i32.const 48) (i32.div_u (local.get $v) (i32.const 100))))
        (i32.store8 (i32.const 301) (i32.add (i32.const 48) (i32.rem_u (i32.div_u (local.get $v) (i32.const 10)) (i32.const 10))))
        (i32.store8 (i32.const 302) (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
        (return (i32.const 3))))
    (if (i32.ge_u (local.get $v) (i32.const 10))
      (then
        (i32.store8 (i32.const 300) (i32.add (i32.const 48) (i32.div_u (local.get $v) (i32.const 10))))
        (i32.store8 (i32.const 301) (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
        (return (i32.const 2))))
    (i32.store8 (i32.const 300) (i32.add (i32.const 48) (local.get $v)))
    (i32.const 1))

  (func (export "_start") (local $path i32) (local $err i32) (local $fd i32)
    (drop (call $args_sizes_get (i32.const 0) (i32.const 4)))
    (if (i32.or (i32.lt_u (i32.load (i32.const 0)) (i32.const 2))
                (i32.gt_u (i32.load (i32.const 4)) (i32.const 60000)))
      (then (call $write (i32.const 2) (i32.const 128) (i32.const 33)) (call $proc_exit (i32.const 2))))
    (drop (call $args_get (i32.const 16) (i32.const 1024)))
    (local.set $path (i32.load (i32.const 20)))
    ;; path_open(dirfd 3, lookup flags 0, path, oflags 0, rights: fd_read (bit 1), inheriting 0, fdflags 0)
    (local.set $err (call $path_open (i32.const 3) (i32.const 0) (local.get $path) (call $strlen (local.get $path))
                                     (i32.const 0) (i64.const 2) (i64.const 0) (i32.const 0) (i32.const 96)))
    (if (local.get $err)
      (then
        (call $write (i32.const 2) (i32.const 192) (i32.const 44))
        (call $write (i32.const 2) (i32.const 300) (call $itoa (local.get $err)))
        (call $write (i32.const 2) (i32.const 256) (i32.const 2))
        (call $proc_exit (i32.const 1))))
    (local.set $fd (i32.load (i32.const 96)))
    (block $eof
      (loop $more
        (i32.store (i32.const 64) (i32.const 65536))
        (i32.store (i32.const 68) (i32.const 131072))
        (if (call $fd_read (local.get $fd) (i32.const 64) (i32.const 1) (i32.const 80))
          (then (call $write (i32.const 2) (i32.const 272) (i32.const 23)) (call $proc_exit (i32.const 1))))
        (br_if $eof (i32.eqz (i32.load (i32.const 80))))
        (call $write (i32.const 1) (i32.const 65536) (i32.load (i32.const 80)))
        (br $more)))
    (call $proc_exit (i32.const 0))))
