;; math.eval@1.0.0: evaluate the integer expression in argv[1] (+ - * / %, parentheses, unary minus,
;; 64-bit) and print the result. Exit 1 with a message on stderr for a syntax error or a division by zero.
(module
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $args_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  ;; 0: argc  4: argv size  16: argv ptrs  64: iovec  80: count  128: messages  512: digits  1024: argv buffer
  (data (i32.const 128) "math.eval: syntax error\n")        ;; 24
  (data (i32.const 160) "math.eval: division by zero\n")    ;; 28
  (data (i32.const 192) "math.eval: usage: math.eval EXPR\n") ;; 33
  (global $pos (mut i32) (i32.const 0))

  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 64) (local.get $ptr))
    (i32.store (i32.const 68) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 64) (i32.const 1) (i32.const 80))))
  (func $fail (param $ptr i32) (param $len i32)
    (call $write (i32.const 2) (local.get $ptr) (local.get $len))
    (call $proc_exit (i32.const 1)))

  (func $peek (result i32)
    (block $done
      (loop $skip        ;; spaces are skipped before every token
        (br_if $done (i32.ne (i32.load8_u (global.get $pos)) (i32.const 32)))
        (global.set $pos (i32.add (global.get $pos) (i32.const 1)))
        (br $skip)))
    (i32.load8_u (global.get $pos)))
  (func $advance (global.set $pos (i32.add (global.get $pos) (i32.const 1))))

  (func $primary (result i64) (local $c i32) (local $v i64) (local $digits i32)
    (local.set $c (call $peek))
    (if (i32.eq (local.get $c) (i32.const 45))             ;; '-'
      (then (call $advance) (return (i64.sub (i64.const 0) (call $primary)))))
    (if (i32.eq (local.get $c) (i32.const 40))             ;; '('
      (then
        (call $advance)
        (local.set $v (call $expr))
        (if (i32.ne (call $peek) (i32.const 41)) (then (call $fail (i32.const 128) (i32.const 24))))
        (call $advance)
        (return (local.get $v))))
    (block $end
      (loop $digit
        (local.set $c (i32.load8_u (global.get $pos)))
        (br_if $end (i32.or (i32.lt_u (local.get $c) (i32.const 48)) (i32.gt_u (local.get $c) (i32.const 57))))
        (local.set $v (i64.add (i64.mul (local.get $v) (i64.const 10)) (i64.extend_i32_u (i32.sub (local.get $c) (i32.const 48)))))
        (local.set $digits (i32.add (local.get $digits) (i32.const 1)))
        (call $advance)
        (br $digit)))
    (if (i32.eqz (local.get $digits)) (then (call $fail (i32.const 128) (i32.const 24))))
    (local.get $v))

  (func $term (result i64) (local $v i64) (local $r i64) (local $op i32)
    (local.set $v (call $primary))
    (block $done
      (loop $more
        (local.set $op (call $peek))
        (br_if $done (i32.and (i32.ne (local.get $op) (i32.const 42))
                              (i32.and (i32.ne (local.get $op) (i32.const 47)) (i32.ne (local.get $op) (i32.const 37)))))
        (call $advance)
        (local.set $r (call $primary))
        (if (i32.eq (local.get $op) (i32.const 42))
          (then (local.set $v (i64.mul (local.get $v) (local.get $r))))
          (else
            (if (i64.eqz (local.get $r)) (then (call $fail (i32.const 160) (i32.const 28))))
            (if (i32.eq (local.get $op) (i32.const 47))
              (then (local.set $v (i64.div_s (local.get $v) (local.get $r))))
              (else (local.set $v (i64.rem_s (local.get $v) (local.get $r)))))))
        (br $more)))
    (local.get $v))

  (func $expr (result i64) (local $v i64) (local $op i32)
    (local.set $v (call $term))
    (block $done
      (loop $more
        (local.set $op (call $peek))
        (br_if $done (i32.and (i32.ne (local.get $op) (i32.const 43)) (i32.ne (local.get $op) (i32.const 45))))
        (call $advance)
        (if (i32.eq (local.get $op) (i32.const 43))
          (then (local.set $v (i64.add (local.get $v) (call $term))))
          (else (local.set $v (i64.sub (local.get $v) (call $term)))))
        (br $more)))
    (local.get $v))

  ;; decimal text of $v ending at 600 (exclusive); returns its start
  (func $itoa (param $v i64) (result i32) (local $p i32) (local $neg i32)
    (local.set $p (i32.const 600))
    (i32.store8 (local.get $p) (i32.const 10))               ;; newline after the number
    (if (i64.lt_s (local.get $v) (i64.const 0))
      (then (local.set $neg (i32.const 1)) (local.set $v (i64.sub (i64.const 0) (local.get $v)))))
    (loop $digit
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i32.store8 (local.get $p) (i32.add (i32.const 48) (i32.wrap_i64 (i64.rem_u (local.get $v) (i64.const 10)))))
      (local.set $v (i64.div_u (local.get $v) (i64.const 10)))
      (br_if $digit (i64.ne (local.get $v) (i64.const 0))))
    (if (local.get $neg)
      (then (local.set $p (i32.sub (local.get $p) (i32.const 1))) (i32.store8 (local.get $p) (i32.const 45))))
    (local.get $p))

  (func (export "_start") (local $v i64) (local $start i32)
    (drop (call $args_sizes_get (i32.const 0) (i32.const 4)))
    (if (i32.or (i32.lt_u (i32.load (i32.const 0)) (i32.const 2)) (i32.gt_u (i32.load (i32.const 4)) (i32.const 60000)))
      (then (call $fail (i32.const 192) (i32.const 33))))
    (drop (call $args_get (i32.const 16) (i32.const 1024)))
    (global.set $pos (i32.load (i32.const 20)))
    (local.set $v (call $expr))
    (if (i32.ne (call $peek) (i32.const 0)) (then (call $fail (i32.const 128) (i32.const 24))))
    (local.set $start (call $itoa (local.get $v)))
    (call $write (i32.const 1) (local.get $start) (i32.sub (i32.const 601) (local.get $start)))
    (call $proc_exit (i32.const 0))))
