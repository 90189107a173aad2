;; asks for a table of 100 million entries
(module (table 100000000 funcref) (func (export "_start")))
