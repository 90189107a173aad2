;; loops in its start function, which runs while the module is instantiated
(module (func $spin (loop $l (br $l))) (start $spin) (func (export "_start")))
