# Finds what the Python package (python/) needs, for CMakeLists.txt: the
# interpreter it is built for and tested with, CUBUF_PYTHON (default
# /usr/bin/python3 where it exists, else the python3 find_package finds), and
# that interpreter's development files (Python.h). Sets CUBUF_PYTHON_FOUND,
# and CUBUF_PYTHON_WHY when it is false.
if(EXISTS /usr/bin/python3)
  set(cubuf_python_default /usr/bin/python3)
else()
  set(cubuf_python_default "")
endif()
set(CUBUF_PYTHON "${cubuf_python_default}" CACHE FILEPATH
    "Python interpreter the cubuf package is built for and tested with (empty: the one find_package finds)")
if(CUBUF_PYTHON)
  set(Python3_EXECUTABLE "${CUBUF_PYTHON}")
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
set(CUBUF_PYTHON_FOUND FALSE)
if(NOT Python3_Interpreter_FOUND)
  set(CUBUF_PYTHON_WHY "no Python interpreter (set CUBUF_PYTHON)")
elseif(NOT Python3_Development.Module_FOUND)
  set(CUBUF_PYTHON_WHY "no development files (Python.h) for ${Python3_EXECUTABLE} (Debian: apt-get install python3-dev)")
else()
  set(CUBUF_PYTHON_FOUND TRUE)
  set(CUBUF_PYTHON "${Python3_EXECUTABLE}" CACHE FILEPATH "" FORCE)
endif()
