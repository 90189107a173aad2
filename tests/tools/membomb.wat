;; grows its memory a page at a time until the store's limit refuses, then traps
(module
  (memory (export "memory") 1)
  (func (export "_start")
    (loop $more
      (br_if $more (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    unreachable))
