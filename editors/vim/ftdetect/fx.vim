au BufRead,BufNewFile *.fx set filetype=fx
