;; two linear memories (multi-memory): each would fit memory_mb, together they would not
(module (memory 60) (memory 60) (func (export "_start")))
