"""Is the kernel right: shapes, tolerances, references, memory estimates, intractable cases."""
