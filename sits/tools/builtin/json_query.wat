;; json.query@1.0.0: print the value at a dotted path in a JSON document, as it is written there.
;; argv[1] = the document (JSON text), argv[2] = the path: keys and array indexes joined by '.'
;; ("items.0.name"); an empty path prints the whole document. Keys compare byte for byte with the
;; document's spelling. Exit 1 with a message on stderr when the path leads nowhere or the JSON is
;; malformed.
(module
  (import "wasi_snapshot_preview1" "args_sizes_get" (func $args_sizes_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "args_get" (func $args_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 4)
  ;; 0: argc  4: argv size  16: argv ptrs  64: iovec  80: count  128: messages  1024: argv buffer
  (data (i32.const 128) "json.query: no value at that path\n")          ;; 34
  (data (i32.const 192) "json.query: malformed JSON\n")                 ;; 27
  (data (i32.const 256) "json.query: usage: json.query DOCUMENT PATH\n") ;; 44
  (data (i32.const 320) "\n")
  (global $pos (mut i32) (i32.const 0))

  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 64) (local.get $ptr))
    (i32.store (i32.const 68) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 64) (i32.const 1) (i32.const 80))))
  (func $fail (param $ptr i32) (param $len i32)
    (call $write (i32.const 2) (local.get $ptr) (local.get $len))
    (call $proc_exit (i32.const 1)))
  (func $not_found (call $fail (i32.const 128) (i32.const 34)))
  (func $malformed (call $fail (i32.const 192) (i32.const 27)))

  (func $at (result i32) (i32.load8_u (global.get $pos)))
  (func $step (global.set $pos (i32.add (global.get $pos) (i32.const 1))))
  (func $ws (local $c i32)
    (block $done
      (loop $more
        (local.set $c (call $at))
        (br_if $done (i32.and (i32.ne (local.get $c) (i32.const 32))
                              (i32.and (i32.ne (local.get $c) (i32.const 9))
                                       (i32.and (i32.ne (local.get $c) (i32.const 10)) (i32.ne (local.get $c) (i32.const 13))))))
        (call $step)
        (br $more))))

  ;; at an opening quote: past the closing one
  (func $skip_string (local $c i32)
    (call $step)
    (loop $more
      (local.set $c (call $at))
      (if (i32.eqz (local.get $c)) (then (call $malformed)))
      (call $step)
      (if (i32.eq (local.get $c) (i32.const 92))           ;; a backslash escapes the next byte
        (then (if (i32.eqz (call $at)) (then (call $malformed))) (call $step) (br $more)))
      (br_if $more (i32.ne (local.get $c) (i32.const 34)))))

  ;; past one value (string, object, array, number or literal)
  (func $skip_value (local $c i32) (local $depth i32) (local $start i32)
    (call $ws)
    (local.set $c (call $at))
    (if (i32.eq (local.get $c) (i32.const 34)) (then (call $skip_string) (return)))
    (if (i32.or (i32.eq (local.get $c) (i32.const 123)) (i32.eq (local.get $c) (i32.const 91)))
      (then
        (loop $more
          (local.set $c (call $at))
          (if (i32.eqz (local.get $c)) (then (call $malformed)))
          (if (i32.eq (local.get $c) (i32.const 34)) (then (call $skip_string) (br $more)))
          (if (i32.or (i32.eq (local.get $c) (i32.const 123)) (i32.eq (local.get $c) (i32.const 91)))
            (then (local.set $depth (i32.add (local.get $depth) (i32.const 1)))))
          (if (i32.or (i32.eq (local.get $c) (i32.const 125)) (i32.eq (local.get $c) (i32.const 93)))
            (then (local.set $depth (i32.sub (local.get $depth) (i32.const 1)))))
          (call $step)
          (br_if $more (i32.gt_s (local.get $depth) (i32.const 0))))
        (return)))
    (local.set $start (global.get $pos))
    (block $done
      (loop $more
        (local.set $c (call $at))
        (br_if $done (i32.eqz (local.get $c)))
        (br_if $done (i32.eq (local.get $c) (i32.const 44)))     ;; ,
        (br_if $done (i32.eq (local.get $c) (i32.const 125)))    ;; }
        (br_if $done (i32.eq (local.get $c) (i32.const 93)))     ;; ]
        (br_if $done (i32.le_u (local.get $c) (i32.const 32)))   ;; whitespace
        (call $step)
        (br $more)))
    (if (i32.eq (local.get $start) (global.get $pos)) (then (call $malformed))))

  (func $equal (param $a i32) (param $a_end i32) (param $b i32) (param $b_end i32) (result i32)
    (if (i32.ne (i32.sub (local.get $a_end) (local.get $a)) (i32.sub (local.get $b_end) (local.get $b)))
      (then (return (i32.const 0))))
    (block $no
      (loop $more
        (br_if $no (i32.ge_u (local.get $a) (local.get $a_end)))
        (if (i32.ne (i32.load8_u (local.get $a)) (i32.load8_u (local.get $b))) (then (return (i32.const 0))))
        (local.set $a (i32.add (local.get $a) (i32.const 1)))
        (local.set $b (i32.add (local.get $b) (i32.const 1)))
        (br $more)))
    (i32.const 1))

  ;; from the start of an object's value: to the value of key [$s, $e)
  (func $member (param $s i32) (param $e i32) (local $key i32) (local $key_end i32)
    (call $step)                                             ;; past '{'
    (loop $next
      (call $ws)
      (if (i32.ne (call $at) (i32.const 34)) (then (call $not_found)))
      (local.set $key (i32.add (global.get $pos) (i32.const 1)))
      (call $skip_string)
      (local.set $key_end (i32.sub (global.get $pos) (i32.const 1)))
      (call $ws)
      (if (i32.ne (call $at) (i32.const 58)) (then (call $malformed)))
      (call $step)
      (if (call $equal (local.get $key) (local.get $key_end) (local.get $s) (local.get $e)) (then (return)))
      (call $skip_value)
      (call $ws)
      (if (i32.ne (call $at) (i32.const 44)) (then (call $not_found)))
      (call $step)
      (br $next)))

  ;; from the start of an array: to its element number [$s, $e) (decimal)
  (func $element (param $s i32) (param $e i32) (local $n i32) (local $c i32) (local $p i32)
    (if (i32.eq (local.get $s) (local.get $e)) (then (call $not_found)))
    (local.set $p (local.get $s))
    (loop $digit
      (local.set $c (i32.load8_u (local.get $p)))
      (if (i32.or (i32.lt_u (local.get $c) (i32.const 48)) (i32.gt_u (local.get $c) (i32.const 57)))
        (then (call $not_found)))
      (if (i32.gt_u (local.get $n) (i32.const 10000000)) (then (call $not_found)))
      (local.set $n (i32.add (i32.mul (local.get $n) (i32.const 10)) (i32.sub (local.get $c) (i32.const 48))))
      (local.set $p (i32.add (local.get $p) (i32.const 1)))
      (br_if $digit (i32.lt_u (local.get $p) (local.get $e))))
    (call $step)                                             ;; past '['
    (call $ws)
    (if (i32.eq (call $at) (i32.const 93)) (then (call $not_found)))
    (block $found
      (loop $next
        (br_if $found (i32.eqz (local.get $n)))
        (call $skip_value)
        (call $ws)
        (if (i32.ne (call $at) (i32.const 44)) (then (call $not_found)))
        (call $step)
        (local.set $n (i32.sub (local.get $n) (i32.const 1)))
        (br $next))))

  (func (export "_start") (local $path i32) (local $s i32) (local $e i32) (local $c i32) (local $start i32)
    (drop (call $args_sizes_get (i32.const 0) (i32.const 4)))
    (if (i32.or (i32.lt_u (i32.load (i32.const 0)) (i32.const 2)) (i32.gt_u (i32.load (i32.const 4)) (i32.const 250000)))
      (then (call $fail (i32.const 256) (i32.const 44))))
    (drop (call $args_get (i32.const 16) (i32.const 1024)))
    (global.set $pos (i32.load (i32.const 20)))
    (local.set $path (i32.const 330))                        ;; no path argument: the empty path (zeroed memory)
    (if (i32.ge_u (i32.load (i32.const 0)) (i32.const 3)) (then (local.set $path (i32.load (i32.const 24)))))
    (local.set $s (local.get $path))
    (block $walked
      (loop $segment
        (br_if $walked (i32.eqz (i32.load8_u (local.get $s))))
        (local.set $e (local.get $s))
        (block $cut
          (loop $scan
            (local.set $c (i32.load8_u (local.get $e)))
            (br_if $cut (i32.or (i32.eqz (local.get $c)) (i32.eq (local.get $c) (i32.const 46))))
            (local.set $e (i32.add (local.get $e) (i32.const 1)))
            (br $scan)))
        (call $ws)
        (local.set $c (call $at))
        (if (i32.eq (local.get $c) (i32.const 123))
          (then (call $member (local.get $s) (local.get $e)))
          (else
            (if (i32.eq (local.get $c) (i32.const 91))
              (then (call $element (local.get $s) (local.get $e)))
              (else (call $not_found)))))
        (local.set $s (local.get $e))
        (if (i32.eq (i32.load8_u (local.get $s)) (i32.const 46)) (then (local.set $s (i32.add (local.get $s) (i32.const 1)))))
        (br $segment)))
    (call $ws)
    (local.set $start (global.get $pos))
    (call $skip_value)
    (call $write (i32.const 1) (local.get $start) (i32.sub (global.get $pos) (local.get $start)))
    (call $write (i32.const 1) (i32.const 320) (i32.const 1))
    (call $proc_exit (i32.const 0))))
