;; never ends: stopped by fuel or by the epoch deadline
(module (func (export "_start") (loop $l (br $l))) (memory (export "memory") 1))
