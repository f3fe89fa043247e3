include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS dtensor EXPORT dtensorTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/dtensor DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET dtrun)
  install(TARGETS dtrun RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
install(EXPORT dtensorTargets NAMESPACE dtensor:: FILE dtensorTargets.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)
configure_package_config_file(cmake/dtensorConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/dtensorConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/dtensorConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/dtensorConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/dtensorConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/dtensor)
